"""Dropout under accumulation and on ranks: which masks do micro-batches and shards draw?

Measured on CPU: one dropout layer draws its micro-batch masks from the same stream in the same order
as the global batch, so plain accumulation matches (the case ``dropout_one_layer``). With two layers
the draws interleave (layer 1 of chunk 1, layer 2 of chunk 1, layer 1 of chunk 2, ...) and every
micro-batch gets other masks: ``dropout_two_layers`` catches that, and ``replayed_dropout`` fixes it
by applying each micro-batch's rows of the masks the global batch draws.

On ranks every regime places dropout in the global batch's masks (equivcheck.regimes.aligned_dropout): a DDP or
FSDP shard applies its rows, a tensor-parallel shard its slice, checkpointed blocks draw again what they drew. The
pitfall there: a TP group's ranks seeded apart (seed + rank), drawing other masks for the activations they hold alike.
"""

import dataclasses
from functools import partial

import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from .mlp import data


def two_layers():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Dropout(0.5), nn.Linear(10, 10), nn.Tanh(), nn.Dropout(0.5),
                         nn.Linear(10, 3))


def one_layer():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Dropout(0.5), nn.Linear(10, 3))


dropout_two_layers = ec.register_case(ec.Case(
    name="dropout_two_layers",
    model=two_layers,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=3,
    regimes=("full_batch", "replayed_dropout:chunks=4", "accumulate:chunks=4", "ddp:world_size=2",
             "ddp_no_sync:world_size=2,chunks=2", "fsdp:world_size=2", "tp:world_size=2",
             "tp_dropout_rank_seeded:world_size=2"),
    expect_mismatch={"accumulate": "two dropout layers: micro-batches interleave their draws and get other masks",
                     "tp_dropout_rank_seeded": "ranks seeded apart draw other masks for the activations they share"},
    description="pitfall: dropout masks differ per micro-batch; twin: replay the global batch's masks",
))

dropout_one_layer = ec.register_case(dataclasses.replace(
    dropout_two_layers,
    name="dropout_one_layer",
    model=one_layer,
    regimes=("full_batch", "accumulate:chunks=4", "replayed_dropout:chunks=4"),
    expect_mismatch={},
    description="one dropout layer on CPU: micro-batches draw the global batch's masks in order (measured)",
    cpu_generator_only="one dropout layer draws a micro-batch's masks in the global batch's order only on the "
                       "CPU generator (on CUDA accumulate differs from full batch by 0.29: measured)",
))

# The catalogue's entries that use these cases.
add_entry(Entry("dropout masks drawn per micro-batch", "dropout_two_layers", "accumulate:chunks=4",
                "replayed_dropout:chunks=4"))

checkpoint_dropout = ec.register_case(dataclasses.replace(
    dropout_one_layer,
    name="checkpoint_dropout",
    regimes=("full_batch", "accumulate:chunks=4", "checkpoint:chunks=4", "checkpoint_without_rng_state:chunks=4"),
    expect_mismatch={"checkpoint_without_rng_state": "the recomputed forward draws new dropout masks"},
    description="pitfall: activation checkpointing without preserving the RNG state, under dropout",
))

add_entry(Entry("checkpoint(preserve_rng_state=False) with dropout", "checkpoint_dropout",
                "checkpoint_without_rng_state:chunks=4"))

add_entry(Entry("dropout seeded per rank inside a tensor-parallel group", "dropout_two_layers",
                "tp_dropout_rank_seeded:world_size=2"))


class Checkpointed(nn.Module):
    """A block recomputed in the backward (non-reentrant checkpoint, the RNG state preserved, as by default)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def checkpointed_block():
    return nn.Sequential(Checkpointed(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Dropout(0.5), nn.Linear(10, 10))),
                         nn.Tanh(), nn.Dropout(0.5), nn.Linear(10, 3))


checkpointed_dropout = ec.register_case(dataclasses.replace(
    dropout_two_layers,
    name="checkpointed_dropout",
    model=checkpointed_block,
    regimes=("full_batch", "ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=2", "fsdp:world_size=2",
             "tp:world_size=2", "fsdp_tp:dp=2,tp=2"),
    expect_mismatch={},
    description="dropout inside a checkpointed block, on ranks: the recomputation draws again the masks it drew",
))
