"""ByteDance-Seed/VeOmni#184: under FSDP2 HSDP the clip norm summed shard statistics over replicas too.

VeOmni clips gradients with its own ``clip_grad_norm``: each rank adds up the squares of the gradient shard it
holds, the sums are all-reduced and the root is the global norm. Under HSDP (a ``dp_replicate x dp_shard`` mesh)
every shard exists once per replica after FSDP2's replicate all-reduce, but the sum ran over the whole FSDP group,
so each squared entry counted ``dp_replicate`` times: the norm came out ``sqrt(dp_replicate)`` times too large and
every step whose norm exceeded ``max_norm`` was clipped harder than one process clipping the same global batch's
gradient once with its true norm. The fix (pull #862) reduces the shard statistics over the ``dp_shard`` group only.
Here 4 ranks form 2 replicas of 2 shards, and the reference clips the full batch's gradient once with
``torch.nn.utils.clip_grad_norm_``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once, mesh_where

BUG = Bug("ByteDance-Seed/VeOmni", "issue", 184, "fsdp",
          "HSDP clip norm all-reduced over replicate x shard: norm sqrt(R) too large, over-clipped",
          fixed_by="pull #862", fix_acts="gradient")

REPLICAS = 2
WORLD_SIZE = 4  # 2 replicas x 2 shards: with 1 shard FSDP2 would all-reduce only, never reduce-scatter
MAX_NORM = 0.5  # below block_stack's gradient norm at every step: clipping engages


def hsdp(model):
    """The team's HSDP wrap: 2 replicas of W/2 shards (dp_replicate x dp_shard), every block, then the root."""
    mesh = mesh_where(model, (REPLICAS, dist.get_world_size() // REPLICAS), ("dp_replicate", "dp_shard"))
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def clip_grad_norm(model, max_norm, group_of=lambda mesh: mesh["dp_shard"].get_group()):
    """VeOmni's clip: local sums of squares of the held shards, all-reduced over ``group_of(mesh)``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = sum(g.to_local().pow(2).sum() for g in grads)
    dist.all_reduce(squares, group=group_of(grads[0].device_mesh))
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.to_local().mul_(coefficient)
    return total


def rank_loss(model, batch):
    """This rank's loss sum over the global sample count, times the world size: FSDP2 averages it to the mean."""
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    return F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / samples


def train_step(model, optimizer, batch, group_of=lambda mesh: mesh["dp_shard"].get_group()):
    loss = rank_loss(model, batch)
    loss.backward()
    clip_grad_norm(model, MAX_NORM, group_of)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    """The whole FSDP group (dp_replicate x dp_shard: here the world) sums the shard statistics."""
    return train_step(model, optimizer, batch, group_of=lambda mesh: None)


clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, clip_once_with_the_global_norm, world_size=WORLD_SIZE,
                         wrap=hsdp)


def fixed():
    return ec.check_step("block_stack", train_step, clip_once_with_the_global_norm, world_size=WORLD_SIZE, wrap=hsdp)
