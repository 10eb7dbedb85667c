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


class Slot(nn.Module):
    """One adapter slot's low-rank factors (drawn small and nonzero, as LoRALinear's)."""

    def __init__(self, features: int, out: int, rank: int = 2) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.randn(rank, features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(out, rank) * 0.1)


class MultiLoRALinear(nn.Module):
    """A frozen linear layer with its adapters in slots (``adapters.<slot>.``, as Multi-LoRA lays them out), one
    slot trained here: ``base(x) + 2 * (x @ A^T) @ B^T``."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.base = nn.Linear(features, out).requires_grad_(False)
        self.adapters = nn.ModuleList([Slot(features, out)])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        slot = self.adapters[0]
        return self.base(inputs) + 2.0 * (inputs @ slot.lora_a.T) @ slot.lora_b.T


class FrozenEmbeddingMultiLoRALM(FrozenEmbeddingLM):
    """FrozenEmbeddingLM with its adapters in Multi-LoRA slots."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(MultiLoRALinear(DIM, HIDDEN), nn.Tanh(), MultiLoRALinear(HIDDEN, DIM))
        self.head = MultiLoRALinear(DIM, VOCAB)


frozen_embedding_slots = ec.register_case(dataclasses.replace(
    lora_tied, name="field_multi_lora_frozen_embedding", model=FrozenEmbeddingMultiLoRALM, split=None, regimes=(),
    expect_mismatch={}, description="Multi-LoRA slots on the block and output layer of an LM, its embedding frozen"))

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
