"""Lightning-AI/pytorch-lightning#18086: with manual optimization and DDP's static_graph, step 1 was never all-reduced.

With ``static_graph=True`` DDP reduces nothing during the first backward: it counts which gradients the graph
produces, and ``_DDPSink``, the autograd function DDP puts on its forward's output, queues one delayed all-reduce of
every gradient at the end of that backward. Lightning runs the LightningModule's ``training_step`` as DDP's forward,
so with manual optimization the user's ``manual_backward`` and ``optimizer.step()`` run inside the forward, before
DDP's output (and its sink) exists: the first backward ran with no sink in its graph, the delayed all-reduce was never
queued, and each rank stepped on its own shard's gradient, so the replicas parted at step 1. One process steps on the
gradient of the whole global batch. The fix (pull #21251) has the strategy's ``post_backward`` run the reducer's
delayed all-reduce itself on that first static-graph backward.
"""

import dataclasses

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._lightning import manual_training_step

BUG = Bug("Lightning-AI/pytorch-lightning", "issue", 18086, "ddp",
          "manual optimization with static_graph: the first backward's delayed all-reduce never queued",
          fixed_by="pull #21251", fix_acts="communication")


def two_steps_of_data():
    return torch.randn(24, 6), torch.randint(0, 3, (24,))


# mlp over 2 steps: the first is the static graph's delayed all-reduce; the second runs on the reducer's recorded
# graph. A third would trip the installed torch's check that buckets are not rebuilt while a backward is expected
# (DDP's forward readies the reducer again after training_step has already run the backward).
TWO_STEPS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_manual_static_graph", data=two_steps_of_data, steps=2,
    description="mlp over 2 steps, for a LightningModule that optimizes by hand under static_graph"))


class LightningModule(nn.Module):
    """The user's module: ``automatic_optimization = False``; ``training_step`` backs up and steps by hand."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.strategy = None

    def manual_backward(self, loss):
        self.strategy.pre_backward()
        loss.backward()
        self.strategy.post_backward()

    def forward(self, batch, optimizer):  # training_step, run as DDP's forward
        return manual_training_step(self, batch, optimizer)


class DDPStrategy:
    """Lightning's DDP strategy, the hooks around ``manual_backward``."""

    def __init__(self, model, runs_delayed_all_reduce=True):
        self.model = model
        self.runs_delayed_all_reduce = runs_delayed_all_reduce

    def pre_backward(self):  # prepare_for_backward: the reducer expects this backward
        self.model.reducer._rebuild_buckets()
        self.model.reducer.prepare_for_backward([])

    def post_backward(self):
        model = self.model
        if self.runs_delayed_all_reduce and model.static_graph and not model._static_graph_delay_allreduce_enqueued:
            model.reducer._delay_all_reduce()  # the fix: what _DDPSink would have queued on the first backward
            model._static_graph_delay_allreduce_enqueued = True


def lightning_ddp(model, runs_delayed_all_reduce=True):
    """DDPStrategy(static_graph=True): the team's wrap builds its own DDP, so the option is given here."""
    wrapped = DistributedDataParallel(LightningModule(model), static_graph=True)
    wrapped.module.strategy = DDPStrategy(wrapped, runs_delayed_all_reduce)
    return wrapped


def lightning_ddp_as_reported(model):
    return lightning_ddp(model, runs_delayed_all_reduce=False)


def train_step(model, optimizer, batch):
    return model(batch, optimizer)


def buggy():
    return ec.check_step(TWO_STEPS, train_step, world_size=2, wrap=lightning_ddp_as_reported)


def fixed():
    return ec.check_step(TWO_STEPS, train_step, world_size=2, wrap=lightning_ddp)
