"""NVIDIA-NeMo/Megatron-Bridge#5963: Multi-LoRA's adapters were taken for base weights; recompute left them untrained.

Under full-layer activation recompute with a frozen base, the embedding's output needs no gradient, so the recompute
setup makes the TransformerBlock's input require one whenever every trainable parameter is an adapter, which it told
by the singular ``.adapter.`` in the parameter's path. Multi-LoRA keeps its slots under ``.adapters.<slot>.``: its
parameters looked like trainable base weights, the input-gradient hook was skipped, and the checkpointed block's
adapters got no gradient, silently where anything outside the block still trained. The pull recognises the plural
container too. The row checkpoints the adapted block reentrant, with an adapted output layer outside it, and decides
the hook by the names as the helper did.
"""

from torch.utils.checkpoint import checkpoint

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._adapters import frozen_embedding_slots, stepped, token_mean_loss

BUG = Bug("NVIDIA-NeMo/Megatron-Bridge", "pull", 5963, "adapters",
          "Multi-LoRA slots taken for base weights: recompute's input-grad hook skipped, its adapters untrained",
          fix_acts="backward")


def adapters_only(model, containers) -> bool:
    """The recompute setup's question: is every trainable parameter an adapter (its path holding one of
    ``containers``)?"""
    return all(any(container in name for container in containers)
               for name, parameter in model.named_parameters() if parameter.requires_grad)


def train_step(model, optimizer, batch, containers=(".adapter.", ".adapters.")):
    tokens, targets = batch
    hidden = model.embed(tokens)
    if adapters_only(model, containers):  # the block's input made to require a gradient for recompute's backward
        hidden.requires_grad_(True)
    hidden = hidden + checkpoint(model.block, hidden, use_reentrant=True)
    return stepped(optimizer, token_mean_loss(model.head(hidden), targets))


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, containers=(".adapter.",))


def buggy():
    return ec.check_step(frozen_embedding_slots, train_step_as_reported)


def fixed():
    return ec.check_step(frozen_embedding_slots, train_step)
