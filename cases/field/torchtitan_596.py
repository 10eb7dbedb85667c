"""pytorch/torchtitan#596: under pipeline parallelism each stage clipped its gradients with its own norm.

torchtitan called ``torch.nn.utils.clip_grad_norm_`` on the parameters of the pipeline stage each rank holds. The
DTensor gradients carry the FSDP and TP placements but not the pipeline's, so each stage computed the norm of its
own gradients only and scaled them by ``max_norm`` over that norm: stages got different, too mild clip factors,
where one process scales every gradient by ``max_norm`` over the norm of the whole model's gradient. The fix (pull
#649) raises each stage's norm to the p-th power, all-reduces it over the pipeline group, takes the root and clips
every stage's gradients with that global norm. The reference is the full batch clipped once with its true norm.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once

BUG = Bug("pytorch/torchtitan", "issue", 596, "pipeline",
          "clip_grad_norm_ per pipeline stage: each stage clipped with its own norm, not the global one",
          fixed_by="pull #649", fix_acts="gradient")

MICRO_BATCHES = 4
MAX_NORM = 0.5  # below the norm of block_stack's whole gradient at every step: clipping engages


def build_stage(model):
    """This rank's stage: block_stack's 5 children cut 3 + 2, rank 0 the first stage, rank 1 the last."""
    children = list(model.children())
    cut = (len(children) + 1) // 2
    mine = children[:cut] if dist.get_rank() == 0 else children[cut:]
    return PipelineStage(nn.Sequential(*mine), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def global_mean_part(output, target, samples):
    """A micro-batch's loss sum over the global batch's samples: the micro-batches' add up to the mean."""
    return F.cross_entropy(output, target, reduction="sum") / samples


def clip_grad_norm_(parameters, max_norm, pp_group=None):
    """torchtitan's clip: the local norm, combined over the pipeline group where one is given."""
    parameters = [p for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if pp_group is not None:
        total_norm = total_norm ** 2
        dist.all_reduce(total_norm, group=pp_group)
        total_norm = total_norm ** 0.5
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


def pipelined_step(pp_group=lambda: dist.group.WORLD):
    """The team's step, made afresh for every run: its stage and schedule are built on the first call; the loss
    reads the global batch's samples from the step that runs it (torch 2.11's schedule.step() takes no loss_kwargs)."""
    schedule = stage = samples = None

    def step(model, optimizer, batch):
        nonlocal schedule, stage, samples
        inputs, targets = batch
        samples = len(targets)
        if schedule is None:
            stage = build_stage(model)
            schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, scale_grads=False,
                                     loss_fn=lambda output, target: global_mean_part(output, target, samples))
        losses = []
        if dist.get_rank() == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        clip_grad_norm_(stage.submod.parameters(), MAX_NORM, pp_group())
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).sum().detach() if losses else None

    return step


def train_step():
    return pipelined_step()


def train_step_as_reported():
    """Each stage's own norm: no pipeline group handed to the clip."""
    return pipelined_step(pp_group=lambda: None)


clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, clip_once_with_the_global_norm, world_size=2,
                         pipeline=True, per_run=True)


def fixed():
    return ec.check_step("block_stack", train_step, clip_once_with_the_global_norm, world_size=2, pipeline=True,
                         per_run=True)
