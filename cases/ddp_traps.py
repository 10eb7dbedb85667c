"""DDP's own traps: shards and ranks that hold different numbers of items, and parameters used only in
some micro-batches.

DDP averages gradients over ranks *equally*. A rank's mean loss is therefore right only when every
rank holds the same number of items; a sampler that pads shards to equal size counts the repeated
samples twice. A rank that runs out of data early must train inside ``model.join()``, and its peers' losses
still be normalised by the global batch's items. Accumulating under DDP without ``no_sync()`` gets the numbers right but all-reduces
every micro-batch, which is what accumulation under DDP is meant to avoid.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from .mlp import mlp
from .tokens import tokens

ddp_mean_loss_uneven_tokens = ec.register_case(dataclasses.replace(
    tokens,
    name="ddp_mean_loss_uneven_tokens",
    regimes=("full_batch", "ddp:world_size=2", "ddp_mean_loss:world_size=2"),
    expect_mismatch={"ddp_mean_loss": "the two ranks hold different numbers of real tokens"},
    description="negative control: per-rank mean loss when ranks hold different token counts",
))


def odd_batches():
    return torch.randn(33, 6), torch.randint(0, 3, (33,))


ddp_uneven_shards = ec.register_case(dataclasses.replace(
    mlp,
    name="ddp_uneven_shards",
    data=odd_batches,
    batch_size=11,
    regimes=("full_batch", "ddp:world_size=2", "ddp_mean_loss:world_size=2", "ddp_padded_sampler:world_size=2"),
    expect_mismatch={
        "ddp_mean_loss": "11 samples over 2 ranks: shards of 6 and 5 averaged equally",
        "ddp_padded_sampler": "the sampler repeats sample 0 to give both ranks 6 samples",
    },
    description="negative controls: 11 samples per step over 2 ranks (per-rank mean, padding sampler)",
))

ddp_sync_every_micro_batch = ec.register_case(dataclasses.replace(
    mlp,
    name="ddp_sync_every_micro_batch",
    regimes=("full_batch", "ddp_no_sync:world_size=2,chunks=3", "ddp_sync_every_micro_batch:world_size=2,chunks=3"),
    expect_mismatch={"ddp_sync_every_micro_batch": "right gradients, but 3 all-reduces per step instead of 1"},
    description="negative control: accumulation under DDP that communicates every micro-batch",
))


class RoutedExperts(nn.Module):
    """Two experts; a sample goes to the rare one when its first feature exceeds 1 (a fixed rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.common = nn.Linear(6, 3)
        self.rare = nn.Linear(6, 3)

    def forward(self, x):
        out = self.common(x)
        routed = x[:, 0] > 1.0
        if routed.any():  # the rare expert takes part only in batches that hold a routed sample
            out = out.clone()
            out[routed] = self.rare(x[routed])
        return out


def routed_data():
    """The first sample of each rank's shard (indices 0 and 6 of every 12) goes to the rare expert."""
    inputs = torch.randn(36, 6).clamp(max=0.9)
    inputs[0::6, 0] = 2.0
    return inputs, torch.randint(0, 3, (36,))


routed_experts = ec.register_case(ec.Case(
    name="routed_experts",
    model=RoutedExperts,
    data=routed_data,
    loss=lambda out, target: F.cross_entropy(out, target, reduction="none"),
    batch_size=12,
    steps=3,
    regimes=("full_batch", "accumulate:chunks=6", "ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=3",
             "ddp_no_sync_find_unused:world_size=2,chunks=3", "ddp_no_sync_static_graph:world_size=2,chunks=3"),
    expect_mismatch={
        "ddp_no_sync": "the rare expert sits out the last micro-batch: DDP without find_unused_parameters "
                       "never finishes its reduction",
        "ddp_no_sync_static_graph": "static_graph=True assumes every iteration uses the same parameters",
    },
    description="DDP trap: a parameter used only in the first micro-batch of each rank under no_sync()",
))

ddp_join_uneven_tail = ec.register_case(dataclasses.replace(
    mlp,
    name="ddp_join_uneven_tail",
    regimes=("full_batch", "ddp_join:world_size=2,chunks=3", "ddp_join_rank_mean:world_size=2,chunks=3",
             "ddp_uneven_micro_batches:world_size=2,chunks=3"),
    expect_mismatch={
        "ddp_join_rank_mean": "each rank's mean: rank 1 sits out the last step (it joined), whose 12 samples then "
                              "count half",
    },
    description="uneven inputs: rank 1 runs out of data a step early and joins (12 samples per step, 2 ranks)",
))

# The catalogue's entries that use these cases.
add_entry(Entry("DDP per-rank mean loss, uneven shards", "ddp_uneven_shards", "ddp_mean_loss:world_size=2"))
add_entry(Entry("DDP per-rank mean loss, uneven token counts", "ddp_mean_loss_uneven_tokens",
                "ddp_mean_loss:world_size=2"))
add_entry(Entry("DDP join, each rank's loss over its own items", "ddp_join_uneven_tail",
                "ddp_join_rank_mean:world_size=2,chunks=3"))
add_entry(Entry("DDP sampler pads shards by repeating samples", "ddp_uneven_shards", "ddp_padded_sampler:world_size=2"))


class WithAuxiliaryHead(nn.Module):
    """A classifier with an auxiliary head that only evaluation uses: in training it never takes part."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh())
        self.head = nn.Linear(10, 3)
        self.auxiliary = nn.Linear(10, 1)

    def forward(self, x):
        hidden = self.body(x)
        return self.head(hidden) if self.training else torch.cat([self.head(hidden), self.auxiliary(hidden)], 1)


unused_branch = ec.register_case(dataclasses.replace(
    mlp,
    name="unused_branch",
    model=WithAuxiliaryHead,
    split=None,
    regimes=("full_batch", "ddp:world_size=2,find_unused_parameters=1",
             "ddp_no_sync:world_size=2,chunks=3,find_unused_parameters=1"),
    description="a parameter no training forward uses: DDP needs find_unused_parameters=True",
))
