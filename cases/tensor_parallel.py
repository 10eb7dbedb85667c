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

add_entry(Entry("tensor parallelism: TP ranks fed different batches", "tp_mlp", "tp_different_batches:world_size=2"))
add_entry(Entry("tensor parallelism: the loss scaled by the TP size", "tp_mlp", "tp_loss_scaled:world_size=2"))
add_entry(Entry("tensor parallelism on a dp x tp mesh: the loss scaled by every rank", "tp_mlp",
                "fsdp_tp_world_scaled:dp=2,tp=2"))
add_entry(Entry("tensor parallelism: clipping by the norm of local shards", "tp_mlp_clipped",
                f"tp_clip_local:world_size=2,max_norm={CLIP}"))
