"""areal-project/AReaL#1273: a loss already normalised over the global batch was divided by the micro-batch count.

AReaL weights each micro-batch's loss by its share of the global batch's tokens, ``w_i / W_total``, so the
micro-batches' losses add up to the global token mean. Megatron-Core's pipeline schedule divides every micro-batch's
output loss by ``num_microbatches`` before its backward, for losses that are per-micro-batch means; on AReaL's
already normalised loss that second division made every gradient, the gradient norm and the update
``num_microbatches`` times smaller than one process's on the same global batch. The fix multiplies AReaL's loss by
``len(mb_list)`` to cancel the schedule's division. Here torch's pipeline schedule stands in for Megatron-Core's,
each micro-batch's loss divided by the micro-batch count before the schedule differentiates it (as Megatron-Core's
``forward_step`` divides its output loss; ``scale_grads=False``), on padded sequences of 1 to 7 real tokens.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("areal-project/AReaL", "pull", 1273, "pipeline",
          "loss already weighted w_i / W_total, divided again by num_microbatches in the pipeline schedule",
          fix_acts="loss")

MICRO_BATCHES = 4  # pipeline_uneven_tokens' 12 sequences a step: micro-batches of 3
IGNORE = -100  # the padding's target


def build_stage(model):
    """This rank's stage: the model's children cut in two, rank 0 the first stage, rank 1 the last."""
    children = list(model.children())
    cut = (len(children) + 1) // 2
    mine = children[:cut] if dist.get_rank() == 0 else children[cut:]
    return PipelineStage(nn.Sequential(*mine), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def token_weighted_loss(multiplier):
    """A micro-batch's loss: its real tokens' sum over the global batch's (w_i / W_total), times ``multiplier``."""
    def loss_fn(output, target, total_tokens):
        summed = F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
        return summed / total_tokens * multiplier
    return loss_fn


def pipelined_step(compensates=True):
    """The team's step, made afresh for every run: its stage and schedule (whose loss is always divided by the
    micro-batch count before backward, as Megatron-Core's is) are built on the first call. The loss reads the global
    batch's tokens from the step that runs it (torch 2.11's schedule.step() takes no loss_kwargs)."""
    schedule = total_tokens = None
    multiplier = MICRO_BATCHES if compensates else 1  # len(mb_list): the fix
    loss_fn = token_weighted_loss(multiplier)

    def step(model, optimizer, batch):
        nonlocal schedule, total_tokens
        inputs, targets = batch
        total_tokens = int((targets != IGNORE).sum())
        if schedule is None:
            schedule = ScheduleGPipe(build_stage(model), n_microbatches=MICRO_BATCHES, scale_grads=False,
                                     loss_fn=lambda out, target: loss_fn(out, target, total_tokens) / MICRO_BATCHES)
        losses = []
        if dist.get_rank() == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).sum().detach() * MICRO_BATCHES / multiplier if losses else None

    return step


def train_step():
    return pipelined_step()


def train_step_as_reported():
    return pipelined_step(compensates=False)


def buggy():
    return ec.check_step("pipeline_uneven_tokens", train_step_as_reported, world_size=2, pipeline=True, per_run=True)


def fixed():
    return ec.check_step("pipeline_uneven_tokens", train_step, world_size=2, pipeline=True, per_run=True)
