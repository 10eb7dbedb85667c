"""huggingface/peft#2803: modules_to_save on a tied embedding and LM head made two trainable copies that diverged.

With ``tie_word_embeddings`` the input embedding and the output layer are one matrix, and full fine-tuning trains it
by the sum of both uses' gradients. ``modules_to_save=["embed_tokens", "lm_head"]`` wrapped each module in its own
``ModulesToSaveWrapper`` with its own trainable copy (huggingface/peft#1750, #2777): the embedding's copy learnt from
the input side alone, the head's from the output side alone. The pull adds ``ensure_weight_tying``: the tied modules
share one wrapper, one trainable copy that both uses train. The row trains ``lora_tied`` (LoRA on a frozen block, the
embedding tied to the output layer) on 2 DDP ranks, the team's wrap making the copies as PEFT made them.
"""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._adapters import lora_tied, stepped, token_mean_loss

BUG = Bug("huggingface/peft", "pull", 2803, "adapters",
          "modules_to_save on tied embed_tokens and lm_head: two trainable copies, each trained by its own use",
          fix_acts="backward")


def modules_to_save(model, ensure_weight_tying=True):
    """The trainable copies PEFT makes of the embedding and the output layer: one shared, or one each."""
    embedding = nn.Parameter(model.trunk.embed.weight.detach().clone())
    model.trunk.embed.weight = embedding
    model.head.weight = embedding if ensure_weight_tying else nn.Parameter(embedding.detach().clone())
    return DistributedDataParallel(model)


def modules_to_save_as_reported(model):
    return modules_to_save(model, ensure_weight_tying=False)


def train_step(model, optimizer, batch):
    tokens, targets = batch
    return stepped(optimizer, token_mean_loss(model(tokens), targets))


def buggy():
    return ec.check_step(lora_tied, train_step, world_size=2, wrap=modules_to_save_as_reported)


def fixed():
    return ec.check_step(lora_tied, train_step, world_size=2, wrap=modules_to_save)
