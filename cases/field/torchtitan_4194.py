"""pytorch/torchtitan#4194: under pipeline parallelism the loss was divided by the token count only after backward.

torchtitan's Forge trainer sums each micro-batch's token losses and divides by the global batch's valid tokens; the
path without a pipeline calls backward on that normalised loss. Under pipeline parallelism the schedule runs
backward inside ``schedule.step()`` on what its loss function returns, here the raw sum (``scale_grads=False``), and
the division by ``global_valid_tokens`` was applied afterwards to the returned losses, for logging only. The logged
loss was right while every gradient was ``global_valid_tokens`` times the full-batch one. The fix passes
``global_valid_tokens`` into the schedule's loss keyword arguments, so each micro-batch's loss is divided before the
schedule differentiates it, and returns the losses already normalised. Here the loss function reads the count from
the step that runs it, as torch 2.11's ``schedule.step()`` takes no loss keyword arguments: the same division, made
in the same place.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/torchtitan", "pull", 4194, "pipeline",
          "PP loss divided by global_valid_tokens after the schedule's backward: grads N times too big",
          fix_acts="loss")

MICRO_BATCHES = 4
IGNORE_INDEX = -100


def build_stage(model):
    """This rank's stage: the tokens model's 4 children cut 2 + 2, rank 0 the first stage, rank 1 the last."""
    children = list(model.children())
    cut = (len(children) + 1) // 2
    mine = children[:cut] if dist.get_rank() == 0 else children[cut:]
    return PipelineStage(nn.Sequential(*mine), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def loss_fn(pred, labels, global_valid_tokens=1):
    """The micro-batch's summed token loss, over the global batch's valid tokens where the trainer passes them."""
    summed = F.cross_entropy(pred.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / global_valid_tokens


def pipelined_step(normalises_in_schedule=True):
    """The team's step, made afresh for every run: its stage and schedule are built on the first call."""
    schedule = global_valid_tokens = None

    def normalised_in_schedule(pred, labels):
        return loss_fn(pred, labels, global_valid_tokens)

    def step(model, optimizer, batch):
        nonlocal schedule, global_valid_tokens
        inputs, labels = batch
        global_valid_tokens = int((labels != IGNORE_INDEX).sum())
        if schedule is None:
            schedule = ScheduleGPipe(build_stage(model), n_microbatches=MICRO_BATCHES, scale_grads=False,
                                     loss_fn=normalised_in_schedule if normalises_in_schedule else loss_fn)
        losses = []
        if dist.get_rank() == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=labels, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        if not losses:
            return None
        loss = torch.stack(losses).sum().detach()
        return loss if normalises_in_schedule else loss / global_valid_tokens

    return step


def train_step():
    return pipelined_step()


def train_step_as_reported():
    """The schedule backs up the raw sums; the division comes after, on the logged loss only."""
    return pipelined_step(normalises_in_schedule=False)


def buggy():
    return ec.check_step("tokens", train_step_as_reported, world_size=2, pipeline=True, per_run=True)


def fixed():
    return ec.check_step("tokens", train_step, world_size=2, pipeline=True, per_run=True)
