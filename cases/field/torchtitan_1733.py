"""pytorch/torchtitan#1733: with gradient accumulation, the schedule's ``scale_grads=True`` rescaled every step.

torchtitan accumulated gradients over several ``schedule.step()`` calls per optimizer step and left the pipeline
schedule at its default ``scale_grads=True``, which divides every parameter's ``.grad`` by ``n_microbatches`` at
the end of each ``step()``. The division hit the gradient accumulated by the earlier calls too, so after K calls the
gradient was ``g_K / M + g_(K-1) / M^2 + ... + g_1 / M^K`` (each micro-batch mean already divided by K), a decaying
average instead of the mean over all K x M micro-batches that one process computes. The fix (pull #1732) builds
the schedule with ``scale_grads=False`` and folds ``1 / (n_microbatches x accumulation steps)`` into the loss, so
the scaling happens once, on each micro-batch's loss.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/torchtitan", "issue", 1733, "pipeline",
          "scale_grads=True with accumulation over step() calls: accumulated grads divided again each call",
          fixed_by="pull #1732", fix_acts="gradient")

MICRO_BATCHES = 2  # per schedule.step(): block_stack's 12 samples in 2 accumulation steps of 2 micro-batches of 3
ACCUMULATION_STEPS = 2


def build_stage(model):
    """This rank's stage: block_stack's 5 children cut 3 + 2, rank 0 the first stage, rank 1 the last."""
    children = list(model.children())
    cut = (len(children) + 1) // 2
    mine = children[:cut] if dist.get_rank() == 0 else children[cut:]
    return PipelineStage(nn.Sequential(*mine), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def rescale_accumulated_loss(scale):
    """The loss of one micro-batch: its mean, times ``scale``."""
    return lambda output, target: F.cross_entropy(output, target) * scale


def pipelined_step(scale_grads=False):
    """The team's step, made afresh for every run: its stage and schedule are built on the first call."""
    schedule = None
    # As fixed, the loss carries 1 / (M x K) and the schedule scales nothing; as reported, the loss carried 1 / K
    # and the schedule divided the gradients by M after every call.
    scale = 1 / ACCUMULATION_STEPS if scale_grads else 1 / (MICRO_BATCHES * ACCUMULATION_STEPS)

    def step(model, optimizer, batch):
        nonlocal schedule
        if schedule is None:
            schedule = ScheduleGPipe(build_stage(model), n_microbatches=MICRO_BATCHES,
                                     loss_fn=rescale_accumulated_loss(scale), scale_grads=scale_grads)
        losses = []
        for inputs, targets in zip(*(part.chunk(ACCUMULATION_STEPS) for part in batch)):
            if dist.get_rank() == 0:
                schedule.step(inputs)
            else:
                micro_batch_losses = []  # step() clears the list it is given
                schedule.step(target=targets, losses=micro_batch_losses)
                losses += micro_batch_losses
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).sum().detach() / (scale * MICRO_BATCHES * ACCUMULATION_STEPS) if losses else None

    return step


def train_step():
    return pipelined_step()


def train_step_as_reported():
    return pipelined_step(scale_grads=True)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, pipeline=True, per_run=True)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, pipeline=True, per_run=True)
