"""huggingface/accelerate#2790: with ``sync_each_batch`` the optimizer stepped on every micro-batch.

``GradientAccumulationPlugin(sync_each_batch=True)`` lets FSDP users keep the gradient reduce-scatter on every
micro-batch instead of entering ``no_sync`` (which holds unsharded gradients in memory). Accelerate implemented it
by setting ``sync_gradients`` on every micro-batch, but ``AcceleratedOptimizer.step()`` and ``zero_grad()`` read
that same flag to decide whether this is the real step: with K accumulation steps the run made K updates, each with
one micro-batch's 1/K-scaled gradient, where one process makes one update with the gradient summed over the K
micro-batches. The fix keeps ``sync_gradients`` true only at the end of each accumulation window and lets
``sync_each_batch`` decide only whether the model's gradient sync is switched off. Here the accelerator is cut down
to those two flags around FSDP2's ``set_requires_gradient_sync``.
"""

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import fully_sharded

BUG = Bug("huggingface/accelerate", "pull", 2790, "fsdp",
          "sync_each_batch set sync_gradients, which also gates the optimizer: a step every micro-batch",
          fix_acts="optimizer")

ACCUMULATION_STEPS = 3  # each rank's 6 samples of block_stack's 12: micro-batches of 2


shard_every_block = fully_sharded  # the team's FSDP2 wrap: every top-level block, then the root


class Accelerator:
    """The part of accelerate at stake: ``sync_gradients`` (the real step) and the model's gradient sync."""

    def __init__(self, steps, sync_each_batch=True, steps_on_sync=False):
        self.steps, self.sync_each_batch, self.steps_on_sync = steps, sync_each_batch, steps_on_sync
        self.step = 0
        self.sync_gradients = True

    def accumulate(self, model):
        """Before each micro-batch's backward (accelerate's ``_do_sync`` then ``no_sync`` context)."""
        self.step += 1
        end = self.step % self.steps == 0
        # As reported, sync_each_batch was folded into sync_gradients; fixed, only the window's end sets it.
        self.sync_gradients = end or (self.sync_each_batch and self.steps_on_sync)
        model.set_requires_gradient_sync(self.sync_gradients or self.sync_each_batch)


class AcceleratedOptimizer:
    def __init__(self, optimizer, accelerator):
        self.optimizer, self.accelerator = optimizer, accelerator

    def step(self):
        if self.accelerator.sync_gradients:
            self.optimizer.step()

    def zero_grad(self):
        if self.accelerator.sync_gradients:
            self.optimizer.zero_grad()


def train_step(model, optimizer, batch, steps_on_sync=False):
    accelerator = Accelerator(ACCUMULATION_STEPS, sync_each_batch=True, steps_on_sync=steps_on_sync)
    optimizer = AcceleratedOptimizer(optimizer, accelerator)
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)  # each rank's sum over the global count, times W: FSDP2 averages it to the mean
    for x, y in zip(inputs.chunk(ACCUMULATION_STEPS), targets.chunk(ACCUMULATION_STEPS)):
        accelerator.accumulate(model)
        (F.cross_entropy(model(x), y, reduction="sum") * dist.get_world_size() / samples).backward()
        optimizer.step()
        optimizer.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, steps_on_sync=True)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, wrap=shard_every_block,
                         syncs_per_step=ACCUMULATION_STEPS)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, wrap=shard_every_block,
                         syncs_per_step=ACCUMULATION_STEPS)
