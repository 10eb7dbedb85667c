"""Lightning-AI/pytorch-lightning#4976: with manual optimization under DDP, the user's backward was never all-reduced.

Lightning's DDP wrapper ran the LightningModule's ``training_step`` as DDP's forward and readied DDP's reducer for
the backward only once that forward returned, assuming the backward would come afterwards. With manual optimization
the user calls ``manual_backward`` and ``optimizer.step()`` inside ``training_step``, so the first backward ran
before the reducer expected it: no gradient was all-reduced and each rank stepped on its own shard, where one
process steps on the gradient of the whole global batch. The fix readies the reducer from ``manual_backward``,
before the user's backward runs, and lets the wrapper skip it when that is done.
"""

import dataclasses

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._lightning import manual_training_step

BUG = Bug("Lightning-AI/pytorch-lightning", "pull", 4976, "ddp",
          "manual optimization: backward ran inside training_step, before DDP readied its all-reduce",
          fix_acts="communication")

def two_steps_of_data():
    return torch.randn(24, 6), torch.randint(0, 3, (24,))


# mlp over 2 steps: the first runs its backward before DDP is ready; the second, on replicas that already differ,
# is reduced by the readiness the first one left behind (a third would trip the installed torch's own check that
# buckets are not rebuilt while a backward is expected).
TWO_STEPS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_manual_optimization", data=two_steps_of_data, steps=2,
    description="mlp over 2 steps, for a LightningModule that optimizes by hand"))


class LightningDistributedDataParallel(DistributedDataParallel):
    """Lightning's DDP: its forward is the module's training step; the reducer is readied after it returns, unless
    ``manual_backward`` already readied it."""

    prepared_for_backward = False

    def reducer_prepare_for_backwards(self):
        self.prepared_for_backward = True
        self.reducer.prepare_for_backward([])

    def _post_forward(self, output):
        if self.prepared_for_backward:
            self.prepared_for_backward = False
            return output
        return super()._post_forward(output)


class ManualOptimizationModule(nn.Module):
    """The user's LightningModule: ``automatic_optimization = False``, backward and step in ``training_step``."""

    def __init__(self, net, prepare_in_manual_backward):
        super().__init__()
        self.net = net
        self.prepare_in_manual_backward = prepare_in_manual_backward
        self.trainer_model = None

    def manual_backward(self, loss):
        if self.prepare_in_manual_backward:  # the fix: the accelerator readies DDP before the user's backward
            self.trainer_model.reducer_prepare_for_backwards()
        loss.backward()

    def forward(self, batch, optimizer):  # training_step, run as DDP's forward
        return manual_training_step(self, batch, optimizer)


def lightning_ddp(model, prepare_in_manual_backward=True):
    wrapped = LightningDistributedDataParallel(ManualOptimizationModule(model, prepare_in_manual_backward))
    wrapped.module.__dict__["trainer_model"] = wrapped  # a plain reference, not a submodule
    return wrapped


def lightning_ddp_as_reported(model):
    return lightning_ddp(model, prepare_in_manual_backward=False)


def train_step(model, optimizer, batch):
    model(batch, optimizer)


def buggy():
    return ec.check_step(TWO_STEPS, train_step, world_size=2, wrap=lightning_ddp_as_reported)


def fixed():
    return ec.check_step(TWO_STEPS, train_step, world_size=2, wrap=lightning_ddp)
