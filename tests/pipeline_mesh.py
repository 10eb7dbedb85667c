"""A team's own three-dimensional mesh, imported by name on the ranks (tests/test_pipeline_mesh.py): pipeline x FSDP2 x
tensor parallelism as torchtitan composes them. Each pipeline stage is one block of the case's model (Linear, GELU,
Linear): its Linears split colwise then rowwise over ``tp``, the block sharded by FSDP2 over ``dp``, the stages driven
by a GPipe schedule over ``pp``. Each data-parallel group is handed its shard; the schedule cuts it into micro-batches.

The case ``pp_blocks`` registers here. A stage's DTensors are whole on its own ranks only, so the team's ``gather``
takes every tensor whole on its stage (``full_tensor()``) and broadcasts it over ``pp`` from that stage's rank."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import equivcheck as ec

MICROBATCHES = 2
CLIP = 0.1  # below every step's gradient norm: clipping engages at each


def block(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 16), nn.GELU(), nn.Linear(16, outputs))


ec.register_case(ec.Case(
    name="pp_blocks", model=lambda: nn.Sequential(block(6, 8), block(8, 3)),
    data=lambda: (torch.randn(48, 6), torch.randint(0, 3, (48,))),
    loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=16, steps=3,
    description="two blocks (Linear, GELU, Linear), a pipeline stage each, on a pp x dp x tp mesh"))

_pipeline: dict = {}  # this rank's stage, its schedule and the pp group, set by parallelize


def _parallelize(model, mesh, loss_fn):
    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    _pipeline.update(stage=stage, stages=stages, group=mesh["pp"].get_group(), tp=mesh["tp"],
                     shapes={name: (p.shape, p.dtype) for name, p in model.named_parameters()})
    mine = model[stage]
    parallelize_module(mine, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(mine, mesh=mesh["dp"])
    piped = PipelineStage(mine, stage, stages, torch.device("cpu"), group=mesh["pp"].get_group())
    _pipeline["schedule"] = ScheduleGPipe(piped, MICROBATCHES, loss_fn=loss_fn)
    return model


def parallelize(model, mesh):
    """A micro-batch's mean loss; the schedule divides the micro-batches' gradients by their count (scale_grads)."""
    return _parallelize(model, mesh, lambda output, target: F.cross_entropy(output, target))


def parallelize_scaled_twice(model, mesh):
    """The micro-batch's mean divided by the micro-batch count by hand too: every gradient 1/K of the global one."""
    return _parallelize(model, mesh, lambda output, target: F.cross_entropy(output, target) / MICROBATCHES)


def _run(inputs, targets, clip=None):
    stage, last = _pipeline["stage"], _pipeline["stage"] == _pipeline["stages"] - 1
    losses = []
    if stage == 0:
        _pipeline["schedule"].step(inputs, target=targets if last else None, losses=losses)
    elif last:
        _pipeline["schedule"].step(target=targets, losses=losses)
    else:
        _pipeline["schedule"].step()
    return torch.stack(losses).mean().detach() if last else None


def step(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    loss = _run(inputs, targets)
    optimizer.step()
    return loss


def step_tp_ranks_differ(model, optimizer, batch):
    """Each TP rank shuffles its group's shard by its own seed: the ranks of one TP group compute on different
    micro-batches."""
    inputs, targets = batch
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(_pipeline["tp"].get_local_rank()))
    optimizer.zero_grad()
    loss = _run(inputs[order], targets[order])
    optimizer.step()
    return loss


def _stage_norm(model) -> torch.Tensor:
    """The norm of this stage's gradient, whole (a DTensor's norm is over every shard of it)."""
    grads = [p.grad for p in model[_pipeline["stage"]].parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _clipped_step(model, optimizer, batch, across_stages: bool):
    inputs, targets = batch
    optimizer.zero_grad()
    loss = _run(inputs, targets)
    norm = _stage_norm(model)
    if across_stages:  # the whole model's norm: every stage's squared norm summed over pp
        squared = norm ** 2
        dist.all_reduce(squared, group=_pipeline["group"])
        norm = squared.sqrt()
    for p in model[_pipeline["stage"]].parameters():
        p.grad.mul_(torch.clamp(CLIP / (norm + 1e-6), max=1.0))
    optimizer.step()
    return loss


def step_clipped(model, optimizer, batch):
    """Clipped by the whole model's gradient norm, as one process clips."""
    return _clipped_step(model, optimizer, batch, across_stages=True)


def step_clipped_per_stage(model, optimizer, batch):
    """Each stage clipped by the norm of its own gradient: the stages scaled apart."""
    return _clipped_step(model, optimizer, batch, across_stages=False)


def gather(name, local):
    """Every tensor whole on its stage's ranks, broadcast over pp from the rank of that stage."""
    owner = int(name.split(".")[0])
    shape, dtype = _pipeline["shapes"][name]
    if owner == _pipeline["stage"]:
        whole = local.full_tensor() if isinstance(local, DTensor) else local.detach().clone()
    else:
        whole = torch.empty(shape, dtype=dtype)
    dist.broadcast(whole, src=dist.get_global_rank(_pipeline["group"], owner), group=_pipeline["group"])
    return whole
