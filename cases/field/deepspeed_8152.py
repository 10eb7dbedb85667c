"""deepspeedai/DeepSpeed#8152: every pipeline stage divided its output gradient by the accumulation steps.

DeepSpeed's PipelineEngine runs each stage's forward through ``DeepSpeedEngine.forward``, which registers a
backward hook dividing the gradient of the stage's output by ``gradient_accumulation_steps``. On the last stage
the loss follows that output, so its gradients come out averaged over the micro-batches; but the gradient it
sends upstream already carries the 1/GAS, and the previous stage's hook divided it again: a stage s stages before the
last got ``1/GAS^(s+1)`` of the averaged gradient (1/64 of it on the first of two stages with GAS = 8) while one
process gives every parameter the average. The fix (pull #8154) applies the scaling on the last stage only. This
module re-creates DeepSpeed's arithmetic in torch-native code: each stage's module divides its output's gradient by
GAS (the number of micro-batches, each with its own mean loss) under torch's pipeline schedule with
``scale_grads=False``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("deepspeedai/DeepSpeed", "issue", 8152, "pipeline",
          "every pipeline stage divided its output grad by GAS: earlier stages got 1/GAS^2, 1/GAS^3, ...",
          fixed_by="pull #8154", fix_acts="backward 2")

GRADIENT_ACCUMULATION_STEPS = 4  # micro-batches per step: block_stack's 12 samples in 4 of 3


class ScaleGrad(torch.autograd.Function):
    """The engine's output backward hook: the identity forward, the gradient divided by GAS."""

    @staticmethod
    def forward(ctx, output):
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad / GRADIENT_ACCUMULATION_STEPS


class EngineStage(nn.Module):
    """A stage's module run as DeepSpeed's engine runs it: its output's gradient scaled where ``scales``."""

    def __init__(self, module, scales):
        super().__init__()
        self.module, self.scales = module, scales

    def forward(self, x):
        output = self.module(x)
        return ScaleGrad.apply(output) if self.scales else output


def build_stage(model, every_stage_scales):
    """This rank's stage: block_stack's 5 children cut 3 + 2, rank 0 the first stage, rank 1 the last."""
    rank, stages = dist.get_rank(), dist.get_world_size()
    children = list(model.children())
    cut = (len(children) + 1) // 2
    mine = nn.Sequential(*(children[:cut] if rank == 0 else children[cut:]))
    is_last = rank == stages - 1
    return PipelineStage(EngineStage(mine, scales=is_last or every_stage_scales), rank, stages, torch.device("cpu"))


def micro_batch_mean(output, target):
    return F.cross_entropy(output, target)


def pipelined_step(every_stage_scales=False):
    """The team's step, made afresh for every run: its stage and schedule are built on the first call."""
    schedule = None

    def step(model, optimizer, batch):
        nonlocal schedule
        if schedule is None:
            schedule = ScheduleGPipe(build_stage(model, every_stage_scales),
                                     n_microbatches=GRADIENT_ACCUMULATION_STEPS, loss_fn=micro_batch_mean,
                                     scale_grads=False)
        inputs, targets = batch
        losses = []
        if dist.get_rank() == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean().detach() if losses else None

    return step


def train_step():
    return pipelined_step()


def train_step_as_reported():
    return pipelined_step(every_stage_scales=True)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, pipeline=True, per_run=True)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, pipeline=True, per_run=True)
