"""baidu-baige/LoongForge#152: the hand-rolled FSDP2 clip summed shard norms over every rank: HSDP replicas counted.

LoongForge's embodied trainer clipped an FSDP2 model with its own ``clip_gradients``: each rank took the squared L2 norm
of the local shards of its DTensor gradients (``_local_tensor``, in float32 with ``torch._foreach_norm``), all-reduced
that sum over the default process group, and scaled every local shard by ``max_norm / (norm + 1e-6)``. That is the
global norm only where the default group is the one shard group. LoongForge also builds HSDP (``--hsdp-shard-size``: a
``replica x shard`` mesh, each shard held once per replica group), and there the sum over every rank counts each shard's
squares once per replica, so the norm came out sqrt(replicas) times too large and every clipped step was clipped harder
than one process clipping the same gradient once. The pull (merged) says only that it corrects the FSDP2 norm and clip
by relying on PyTorch's DTensor-aware utilities, and has no test: its diff replaces the hand-rolled path by
``torch.nn.utils.clip_grad_norm_``, which reduces each gradient over its own mesh and placements. The mechanism is read
from that diff and LoongForge's HSDP mesh; it is the one ByteDance-Seed/ VeOmni#184 reported in VeOmni's own clip. Here
``block_stack`` is wrapped by FSDP2 as LoongForge's planner wraps a model (each block, then the root) on a 2 x 1
``replica x shard`` mesh of 2 gloo ranks (``--hsdp-shard-size 1``, which LoongForge accepts: each replica holds whole
gradients, and the replicas are what the sum counts), with ``max_norm`` below its gradient norm at every step, against
one process clipping the full batch's gradient once. As reported the norm is sqrt(2) too large from step 0 and the
clipped gradients part there; as fixed they match.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once, mesh_where
from equivcheck_cases.field.veomni_184 import rank_loss

BUG = Bug("baidu-baige/LoongForge", "pull", 152, "clipping",
          "hand-rolled FSDP2 clip all-reduced shard norms over every rank: HSDP replicas counted, over-clipped",
          fix_acts="gradient")

REPLICAS, SHARDS = 2, 1  # the replicas are what the fault counts: one shard per replica group shows it on 2 ranks
MAX_NORM = 0.5  # below block_stack's gradient norm at every step: clipping engages
NORM_DTYPE = torch.float64  # LoongForge's float32 accumulator, in the case's float64 (the widest dtype, as there)


def hsdp(model):
    """LoongForge's ``_build_fsdp_device_mesh`` with ``--hsdp-shard-size 1`` (dims "replica" and "shard"), and its
    planner's wrap: each block, then the root."""
    mesh = mesh_where(model, (REPLICAS, SHARDS), ("replica", "shard"))
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _local_gradient_groups(model):
    """LoongForge's helper before the pull: each gradient's local shard, grouped by device and dtype."""
    groups = defaultdict(list)
    for parameter in model.parameters():
        if parameter.grad is not None:
            gradient = parameter.grad._local_tensor if isinstance(parameter.grad, DTensor) else parameter.grad
            groups[(gradient.device, gradient.dtype)].append(gradient)
    return list(groups.values())


def clip_gradients_as_reported(model, max_norm):
    """``clip_gradients`` before the pull: the local shards' squared norms (in float32 there, the case's float64
    here: the widest dtype of the gradients), summed over the default group, one coefficient applied to every local
    shard."""
    if not isinstance(model, FSDPModule):
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    gradient_groups = _local_gradient_groups(model)
    local_norm_sq = torch.zeros((), dtype=NORM_DTYPE, device=next(model.parameters()).device)
    for gradients in gradient_groups:
        local_norm_sq += torch.stack(torch._foreach_norm(gradients, 2.0, dtype=NORM_DTYPE)).pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(local_norm_sq)
    total_norm = local_norm_sq.sqrt()
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for gradients in gradient_groups:
        torch._foreach_mul_(gradients, clip_coef)
    return total_norm.item()


def clip_gradients(model, max_norm):
    """As the pull left it for FSDP2, DDP and unwrapped models: torch's DTensor-aware clip."""
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def train_step(model, optimizer, batch, clip=clip_gradients):
    loss = rank_loss(model, batch)
    loss.backward()
    clip(model, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, clip=clip_gradients_as_reported)


clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, clip_once_with_the_global_norm,
                         world_size=REPLICAS * SHARDS, wrap=hsdp)


def fixed():
    return ec.check_step("block_stack", train_step, clip_once_with_the_global_norm, world_size=REPLICAS * SHARDS,
                         wrap=hsdp)
