"""What the field's adapter rows share: the built-in ``lora_tied`` case (LoRA on a frozen block, the embedding tied to
the output layer), and a LoRA model over a frozen embedding whose output layer is adapted too, as a PEFT fine-tune of
an LM freezes its embedding and adapts its projections."""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck_cases.adapters import HIDDEN, LoRALinear, lora_tied
from equivcheck_cases.tokens import DIM, IGNORE, PAD, VOCAB


class FrozenEmbeddingLM(nn.Module):
    """A frozen embedding, a residual block of two adapted frozen layers, and an adapted frozen output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD).requires_grad_(False)
        self.block = nn.Sequential(LoRALinear(DIM, HIDDEN), nn.Tanh(), LoRALinear(HIDDEN, DIM))
        self.head = LoRALinear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + self.block(hidden))


frozen_embedding = ec.register_case(dataclasses.replace(
    lora_tied, name="field_lora_frozen_embedding", model=FrozenEmbeddingLM, split=None, regimes=(),
    expect_mismatch={}, description="LoRA on the block and the output layer of an LM whose embedding is frozen"))


def token_mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """This rank's token losses summed over the global batch's real tokens, times the world size (DDP averages)."""
    flat = targets.reshape(-1)
    counted = torch.tensor(float((flat != IGNORE).sum()))
    world = 1
    if dist.is_initialized():
        dist.all_reduce(counted)
        world = dist.get_world_size()
    return F.cross_entropy(logits.reshape(len(flat), -1), flat, ignore_index=IGNORE, reduction="sum") * world / counted


def stepped(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()
