"""Tensor parallelism on an MLP whose plan is derived (Linear, GELU, Linear: colwise, then rowwise), on one mesh
dimension and on a dp x tp mesh, and the tensor-parallel pitfalls on it: ranks of one TP group fed different batches,
the loss scaled by the TP size, clipping by the norm of each rank's local shards."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.regimes.pitfalls import clipping_optimizer
from equivcheck.suites.catalogue import Entry, add_entry

CLIP = 0.05  # below the gradient norm of every step: clipping engages at each


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))


def lopsided_model():
    """The MLP with its first 8 hidden units 4 times larger: rank 0's shards then carry most of the gradient's norm,
    so a norm taken per rank differs from rank to rank, as it does in a real model whose shards differ."""
    mlp = model()
    with torch.no_grad():
        mlp[0].weight[:8] *= 4
        mlp[2].weight[:, :8] *= 4
    return mlp


def data():
    return torch.randn(36, 6), torch.randint(0, 3, (36,))


def loss(output, target):
    return F.cross_entropy(output, target, reduction="none")


tp_mlp = ec.register_case(ec.Case(
    name="tp_mlp",
    model=model,
    data=data,
    loss=loss,
    batch_size=12,
    steps=3,
    regimes=("full_batch", "tp:world_size=2", "fsdp_tp:dp=2,tp=2", "tp_different_batches:world_size=2",
             "tp_loss_scaled:world_size=2", "fsdp_tp_world_scaled:dp=2,tp=2"),
    expect_mismatch={
        "tp_different_batches": "each TP rank computes its part of the model on its own half of the batch",
        "tp_loss_scaled": "every gradient 1/2 of the global batch's: the TP size counted as a data-parallel one",
        "fsdp_tp_world_scaled": "the loss times 4 ranks instead of 2 data-parallel groups: every gradient doubled",
    },
    description="6-16-3 GELU MLP, its TP plan derived (colwise, rowwise), on 2 ranks and on a 2 x 2 mesh",
))

tp_mlp_clipped = ec.register_case(dataclasses.replace(
    tp_mlp,
    name="tp_mlp_clipped",
    model=lopsided_model,
    optimizer=clipping_optimizer(CLIP),  # clip_grad_norm_ before each step: over DTensors, the whole gradient's norm
    regimes=("full_batch", "tp:world_size=2", f"tp_clip_local:world_size=2,max_norm={CLIP}"),
    expect_mismatch={"tp_clip_local": "each rank clips by the norm of its own shards, not the whole gradient's"},
    max_norm=CLIP,
    description=f"tp_mlp clipping at {CLIP} before each step; the pitfall clips by each rank's local shards first",
))



def blocks():
    """Two blocks of (Linear, GELU, Linear): a pipeline stage each, each block's pair split colwise then rowwise."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, out))
                           for width, out in ((6, 8), (8, 3))))


tp_blocks = ec.register_case(ec.Case(
    name="tp_blocks",
    model=blocks,
    data=lambda: (torch.randn(48, 6), torch.randint(0, 3, (48,))),
    loss=loss,
    batch_size=16,
    steps=3,
    regimes=("full_batch", "fsdp_tp:dp=2,tp=2", "pp_fsdp_tp:pp=2,dp=2,tp=2", "pp_fsdp_tp_scaled_twice:pp=2,dp=2,tp=2",
             "pp_fsdp_tp_ranks_differ:pp=2,dp=2,tp=2"),
    expect_mismatch={
        "pp_fsdp_tp_scaled_twice": "the faithful share divided by the 2 micro-batches again: half of every gradient",
        "pp_fsdp_tp_ranks_differ": "the two TP ranks of each group compute on differently shuffled micro-batches",
    },
    description="two blocks of Linear, GELU, Linear: a pipeline stage each on a pp x dp x tp mesh (8 ranks)",
))

add_entry(Entry("tensor parallelism: TP ranks fed different batches", "tp_mlp", "tp_different_batches:world_size=2"))
add_entry(Entry("tensor parallelism: the loss scaled by the TP size", "tp_mlp", "tp_loss_scaled:world_size=2"))
add_entry(Entry("tensor parallelism on a dp x tp mesh: the loss scaled by every rank", "tp_mlp",
                "fsdp_tp_world_scaled:dp=2,tp=2"))
add_entry(Entry("pipeline x FSDP2 x TP: the loss scaled by the micro-batch count twice", "tp_blocks",
                "pp_fsdp_tp_scaled_twice:pp=2,dp=2,tp=2"))
add_entry(Entry("pipeline x FSDP2 x TP: a TP group fed different micro-batches", "tp_blocks",
                "pp_fsdp_tp_ranks_differ:pp=2,dp=2,tp=2"))
add_entry(Entry("tensor parallelism: clipping by the norm of local shards", "tp_mlp_clipped",
                f"tp_clip_local:world_size=2,max_norm={CLIP}"))
