"""mindspore-ai/hyper-parallel#526: the clip summed replicated parameters' norms over the shard group too.

hyper-parallel's ``clip_grad_norm_`` (torch platform) under FSDP/HSDP put the local squared norm of the parameters it
does not shard (handed to ``replicate_params``, or left out through FSDP's ``ignored_params`` with their gradients
all-reduced by the training code) into the same SUM all-reduce over the shard process group as the shards' squares.
Those gradients are already whole and equal on every rank, so their squares were counted once per rank: at DP=8 the
report measures a global norm of 48 with ``replicate_params`` and above 100 with ``ignored_params`` plus a manual
all-reduce, where the norm of the gathered full gradient is 28; the first step's loss did not move only because its
norm was under ``max_norm``. The thread (closed, filed three times: #279, #413, #526) names no pull; the clip on
main counts a gradient with no Shard placement locally, with no collective (it groups gradients by mesh and Shard
dimensions and all-reduces each group's sum over those only), and the row's fix is that. Here ``block_stack`` is
FSDP2-sharded over 2 gloo ranks with every Linear's bias in ``ignored_params``, the team averaging those gradients
itself, and ``max_norm`` is below the gradient norm at every step.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once, mesh_where

BUG = Bug("mindspore-ai/hyper-parallel", "issue", 526, "clipping",
          "FSDP clip all-reduced replicated/ignored params' norms over the shard group: counted DP times",
          fixed_by="no pull named; main's clip_grad.py counts unsharded gradients locally, all-reduces Shard dims",
          fix_acts="gradient")

MAX_NORM = 0.5  # below block_stack's gradient norm at every step (0.72, then 1.7): clipping engages


def biases(model):
    """Every Linear's bias, in the model's order (every rank reduces them in one order)."""
    return [module.bias for module in model.modules() if isinstance(module, torch.nn.Linear)]


def fsdp_with_ignored_biases(model):
    """FSDP2 over every rank, block by block then the root, each Linear's bias left to the team (``ignored_params``)."""
    mesh, ignored = mesh_where(model), set(biases(model))
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh, ignored_params=ignored)
    return fully_shard(model, mesh=mesh, ignored_params=ignored)


def clip_grad_norm_(parameters, max_norm, replicated_locally=True):
    """hyper-parallel's clip: the local gradients' squares summed. As reported, one sum all-reduced over the shard
    group whatever each gradient's layout; fixed, a gradient counted locally unless it has a Shard placement, whose
    group's sum is all-reduced over that mesh dimension."""
    parameters = [p for p in parameters if p.grad is not None]
    groups = {}
    for p in parameters:
        if isinstance(p.grad, DTensor):
            shard_dims = tuple(i for i, placement in enumerate(p.grad.placements) if placement.is_shard())
            groups.setdefault((id(p.grad.device_mesh), shard_dims), (p.grad.device_mesh, []))[1].append(p)
        else:
            groups.setdefault((None, ()), (None, []))[1].append(p)
    total = torch.zeros((), dtype=torch.float64)
    shard_group = next(mesh for mesh, _ in groups.values() if mesh is not None).get_group(0)
    if not replicated_locally:
        for _, params in groups.values():
            for p in params:
                total += _local(p.grad).detach().square().sum()
        dist.all_reduce(total, group=shard_group)
    else:
        for (mesh_id, shard_dims), (mesh, params) in groups.items():
            local = sum((_local(p.grad).detach().square().sum() for p in params), torch.zeros((), dtype=torch.float64))
            for dim in shard_dims:
                dist.all_reduce(local, group=mesh.get_group(dim))
            total += local
    total_norm = total.sqrt()
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in parameters:
        _local(p.grad).mul_(coefficient)
    return total_norm


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train_step(model, optimizer, batch, replicated_locally=True):
    """Each rank's mean loss (FSDP2 averages the shards' gradients), the ignored biases' gradients averaged by the
    team's own all-reduce, the clip, one step."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    for bias in biases(model):
        dist.all_reduce(bias.grad)
        bias.grad.div_(dist.get_world_size())
    clip_grad_norm_(model.parameters(), MAX_NORM, replicated_locally)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, replicated_locally=False)

clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, clip_once_with_the_global_norm, world_size=2,
                         wrap=fsdp_with_ignored_biases)


def fixed():
    return ec.check_step("block_stack", train_step, clip_once_with_the_global_norm, world_size=2,
                         wrap=fsdp_with_ignored_biases)
