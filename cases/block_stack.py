"""A transformer-like stack of pre-norm residual blocks, the shape FSDP2 shards block by block and a
pipeline cuts into stages, and FSDP2's accumulation pitfall on it: gradient sync left on, so every micro-batch reduce-scatters."""

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry


class Block(nn.Module):
    """x + MLP(LayerNorm(x)): a transformer block's feed-forward half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model():
    return nn.Sequential(nn.Linear(6, 8), Block(8), Block(8), nn.LayerNorm(8), nn.Linear(8, 3))


def data():
    return torch.randn(36, 6), torch.randint(0, 3, (36,))


block_stack = ec.register_case(ec.Case(
    name="block_stack",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=3,
    regimes=("full_batch", "accumulate:chunks=3", "ddp:world_size=2", "fsdp:world_size=2",
             "fsdp_no_sync:world_size=2,chunks=3", "fsdp_no_sync:world_size=2,chunks=3,reshard_after_forward=0",
             "pipeline:stages=2,microbatches=4", "pipeline:stages=2,microbatches=4,schedule=1f1b",
             "pipeline:stages=2,microbatches=4,schedule=interleaved"),
    description="embedding, 2 pre-norm residual blocks, norm, head: FSDP2 shards each block and the root; "
                "pipeline stages cut its 5 children 3 + 2 (interleaved: 2 + 1 + 1 + 1)",
))

fsdp_sync_every_micro_batch = ec.register_case(dataclasses.replace(
    block_stack,
    name="fsdp_sync_every_micro_batch",
    regimes=("full_batch", "fsdp_no_sync:world_size=2,chunks=3", "fsdp_sync_every_micro_batch:world_size=2,chunks=3"),
    expect_mismatch={"fsdp_sync_every_micro_batch": "right gradients, but 3 reduce-scatters per block per step instead of 1"},
    description="negative control: accumulation under FSDP2 that reduce-scatters every micro-batch",
))

# The catalogue's entries that use these cases.
add_entry(Entry("FSDP2 accumulation with gradient sync left on", "fsdp_sync_every_micro_batch",
                "fsdp_sync_every_micro_batch:world_size=2,chunks=3"))
