"""pytorch/pytorch#88955: FSDP.clip_grad_norm_() counted every NO_SHARD gradient world_size times.

FSDP's ``clip_grad_norm_`` took the norm of the gradients each rank holds, raised it to the p-th power and summed it
over the process group: right for a sharded strategy, whose ranks each hold a disjoint shard, wrong for ``NO_SHARD``,
whose ranks each hold the whole all-reduced gradient. Every gradient was counted once per rank, the norm came out
sqrt(world_size) times too large, and any step whose norm exceeded ``max_norm`` was clipped harder than one process
clipping the same gradient. The pull (landed) sorts the FSDP handles into sharded and non-sharded ones and all-reduces
only the sharded part of the norm, adding the non-sharded part's p-th power locally ("all-reducing the local
non-sharded norm would count it an extra world-size-many times", as torch's code still says). FSDP1 needs an
accelerator on this torch, so the row keeps what ``NO_SHARD`` communicates, every gradient all-reduced and averaged as
DDP does, and hand-writes the clip as it was before and after the pull, on ``block_stack`` over 2 gloo ranks, with
``max_norm`` below the gradient norm at every step.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once

BUG = Bug("pytorch/pytorch", "pull", 88955, "clipping",
          "FSDP.clip_grad_norm_ all-reduced NO_SHARD gradients' norms: each counted world_size times",
          fix_acts="gradient")

MAX_NORM = 0.5  # below block_stack's gradient norm at every step (0.72, then 1.7): clipping engages


def _get_grad_norm(params, norm_type):
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]),
                                    norm_type)


def clip_grad_norm_(params, max_norm, norm_type=2.0, uses_sharded_strategy=False, sharded_apart=True):
    """``FullyShardedDataParallel.clip_grad_norm_`` on a model whose one handle is ``NO_SHARD``
    (``uses_sharded_strategy`` False). As reported, the local norm of every gradient all-reduced over the process
    group; ``sharded_apart`` (the pull): only the sharded handles' norm all-reduced, the non-sharded ones' p-th power
    added locally."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not sharded_apart:
        local_norm = _get_grad_norm(params, norm_type)
        total_norm = local_norm ** norm_type
        dist.all_reduce(total_norm)
        total_norm = total_norm ** (1.0 / norm_type)
    else:
        sharded_params = params if uses_sharded_strategy else []
        nonsharded_params = [] if uses_sharded_strategy else params
        total_norm = _get_grad_norm(sharded_params, norm_type) ** norm_type
        dist.all_reduce(total_norm)
        total_norm += _get_grad_norm(nonsharded_params, norm_type) ** norm_type
        total_norm = total_norm ** (1.0 / norm_type)
    clip_coef = torch.tensor(max_norm, dtype=total_norm.dtype) / (total_norm + 1e-6)
    if clip_coef < 1:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coef)
    return total_norm


def train_step(model, optimizer, batch, sharded_apart=True):
    """Each rank's mean loss, its gradients all-reduced and averaged (NO_SHARD's reduction, here DDP's), FSDP's clip
    on the root, one step."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    clip_grad_norm_([p for p in model.parameters()], MAX_NORM, sharded_apart=sharded_apart)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, sharded_apart=False)

clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, clip_once_with_the_global_norm, world_size=2)


def fixed():
    return ec.check_step("block_stack", train_step, clip_once_with_the_global_norm, world_size=2)
