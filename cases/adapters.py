"""Low-rank adapters on a frozen base with a tied embedding (issue 67), written plainly (no peft).

``AdaptedLM`` is the tokens case's language model with its output layer tied to its input embedding, and a residual
block whose two linear layers are frozen and adapted by LoRA: ``base(x) + (alpha / r) * x A^T B^T``. The adapters'
factors are drawn small and nonzero (LoRA's own init sets B to 0, which leaves A without a gradient at the first
step), so both factors, and the tied embedding its two uses, are judged from step 0. What trains: the embedding
(with the head tied to it) and the four adapter factors; the base layers' weights and biases stay frozen.

Measured on CPU, float64: equivalent under ``accumulate``, ``ddp_no_sync``, ``fsdp`` and ``checkpoint``
(non-reentrant recomputation: the frozen base's outputs still carry the graph to the adapters). The pitfalls, each
caught (tests/test_adapters.py): recomputation that cuts the adapters off (``checkpoint_reentrant``: the trunk under
torch's reentrant checkpoint, whose inputs need no gradient, returns none to anything inside it while the head
trains on; Megatron-Bridge pull #5963's class), and the tying broken by a trainable copy of the output layer (peft pull #2803's
``modules_to_save``: the embedding no longer learns from the head's use of it).
"""

import dataclasses

import torch
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from . import sequence_parallel as sp
from .tokens import DIM, PAD, VOCAB, tokens

HIDDEN, RANK, ALPHA = 12, 2, 4.0


class LoRALinear(nn.Module):
    """A frozen linear layer with a low-rank adapter: ``base(x) + (alpha / rank) * (x @ A^T) @ B^T``."""

    def __init__(self, features: int, out: int, rank: int = RANK, alpha: float = ALPHA) -> None:
        super().__init__()
        self.base = nn.Linear(features, out).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(out, rank) * 0.1)
        self.scale = alpha / rank

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.base(inputs) + self.scale * (inputs @ self.lora_a.T) @ self.lora_b.T


class Trunk(nn.Module):
    """The embedding and a residual block of two adapted frozen layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.block = nn.Sequential(LoRALinear(DIM, HIDDEN), nn.Tanh(), LoRALinear(HIDDEN, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return hidden + self.block(hidden)


class AdaptedLM(nn.Module):
    """The trunk, then an output layer tied to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = Trunk()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.trunk.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(tokens))


def head_to_save(model: AdaptedLM) -> AdaptedLM:
    """A team's wrap as peft's ``modules_to_save=["head"]`` made it before its fix: the output layer replaced by a
    trainable copy, untied from the embedding (each then trains on its own use alone)."""
    model.head.weight = nn.Parameter(model.trunk.embed.weight.detach().clone())
    return model


lora_tied = ec.register_case(dataclasses.replace(
    tokens,
    name="lora_tied",
    model=AdaptedLM,
    split=lambda model: (model.trunk, model.head),
    regimes=("full_batch", "accumulate:chunks=4", "fsdp:world_size=2", "checkpoint:chunks=2",
             "checkpoint_reentrant:chunks=2"),
    expect_mismatch={"checkpoint_reentrant": "the trunk recomputed reentrant from token ids, which need no gradient: "
                                             "none reaches its adapters or the embedding's own use"},
    description="LoRA adapters on a frozen residual block, the embedding tied to the output layer",
))

add_entry(Entry("adapters cut off by reentrant recomputation", "lora_tied", "checkpoint_reentrant:chunks=2"))


class ParallelLoRALinear(nn.Module):
    """A frozen linear layer adapted as Megatron's ``LoraParallelLinear`` lays its factors out, each factor a Linear
    of its own so that a tensor-parallel plan can place it: ``base(x) + (alpha / rank) * lora_b(lora_a(x))``. On a
    column-parallel base, ``lora_a`` is replicated and ``lora_b`` column-parallel; on a row-parallel base, ``lora_a``
    is row-parallel and ``lora_b`` replicated. Under sequence parallelism the replicated factor runs on each rank's
    sequence shard, so its gradient is a sum over the TP group (mcore-bridge pull #173's class when it is not)."""

    def __init__(self, features: int, out: int, rank: int = RANK, alpha: float = ALPHA) -> None:
        super().__init__()
        self.base = nn.Linear(features, out).requires_grad_(False)
        self.lora_a = nn.Linear(features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out, bias=False)
        with torch.no_grad():  # drawn small and nonzero, as LoRALinear's
            self.lora_a.weight.copy_(torch.randn(rank, features) * 0.3)
            self.lora_b.weight.copy_(torch.randn(out, rank) * 0.1)
        self.scale = alpha / rank

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.base(inputs) + self.scale * self.lora_b(self.lora_a(inputs))


class AdaptedBlock(nn.Module):
    """``sp_block``'s pre-norm MLP with its base frozen: the norm and both projections frozen, the projections
    adapted, the per-token head trained."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(sp.FEATURES).requires_grad_(False)
        self.up = ParallelLoRALinear(sp.FEATURES, sp.HIDDEN)
        self.act = nn.GELU()
        self.down = ParallelLoRALinear(sp.HIDDEN, sp.FEATURES)
        self.head = nn.Linear(sp.FEATURES, sp.CLASSES)

    def forward(self, x):
        return self.head(x + self.down(self.act(self.up(self.norm(x)))))


lora_sp_block = ec.register_case(ec.Case(
    name="lora_sp_block",
    model=AdaptedBlock,
    data=sp.data,
    loss=sp.loss,
    items=lambda targets: targets.numel(),
    batch_size=12,
    steps=3,
    # Megatron's layout (LoraParallelLinear): the column-parallel base's lora_a replicated, on sequence shards, and
    # its lora_b column-parallel; the row-parallel base's lora_a row-parallel, its lora_b replicated on sequence shards.
    tp_plan={"norm": "sequence", "up.base": "colwise", "up.lora_a": "sequence", "up.lora_b": "colwise",
             "down.base": "rowwise", "down.lora_a": "rowwise", "down.lora_b": "sequence"},
    regimes=("full_batch", "accumulate:chunks=3", "ddp:world_size=2", "tp_sp:world_size=2",
             "tp_sp_norm_unreduced:world_size=2"),
    expect_mismatch={"tp_sp_norm_unreduced": "the replicated adapter factors (up.lora_a, down.lora_b) run on each "
                                             "rank's half of the sequence, their gradients never summed over TP"},
    description="LoRA on a frozen pre-norm MLP block (Megatron's factor layout) with a per-token head on (12, 8, 8); "
                "tensor + sequence parallel",
))

add_entry(Entry("sequence parallelism: replicated adapter factors not summed over TP", "lora_sp_block",
                "tp_sp_norm_unreduced:world_size=2"))
