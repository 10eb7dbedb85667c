"""locuslab/open-unlearning#178: LoRA layers under reentrant gradient checkpointing never trained (lora_B stayed 0).

The trainer enabled gradient checkpointing on a PEFT model without ``model.enable_input_require_grads()``. Reentrant
checkpointing back-propagates into a checkpointed layer only through an input that requires a gradient, and with the
base (its embedding too) frozen the embedding's output does not: every adapter inside the checkpointed transformer
layers got no gradient, and only what ran outside them trained (the report counted 0 nonzero ``lora_B`` in the
layers after training). Full-batch training without checkpointing gives those adapters their gradient. The fix the
report names makes the embedding's output require a gradient (``enable_input_require_grads``, a forward hook on the
input embeddings); ``use_reentrant=False`` is its sibling. The row checkpoints the adapted block reentrant, the adapted
output layer outside it, on the frozen-embedding LoRA model.
"""

from torch.utils.checkpoint import checkpoint

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._adapters import frozen_embedding, stepped, token_mean_loss

BUG = Bug("locuslab/open-unlearning", "issue", 178, "adapters",
          "reentrant checkpointing over a frozen embedding's output: the checkpointed adapters got no gradient",
          fix_acts="backward")


def train_step(model, optimizer, batch, input_requires_grad=True):
    tokens, targets = batch
    hidden = model.embed(tokens)
    if input_requires_grad:  # model.enable_input_require_grads(): the embedding's output requires a gradient
        hidden.requires_grad_(True)
    hidden = hidden + checkpoint(model.block, hidden, use_reentrant=True)
    return stepped(optimizer, token_mean_loss(model.head(hidden), targets))


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, input_requires_grad=False)


def buggy():
    return ec.check_step(frozen_embedding, train_step_as_reported)


def fixed():
    return ec.check_step(frozen_embedding, train_step)
