"""allenai/open-instruct#1498: manual accumulation under ZeRO-2 stepped on the last micro-batch's gradient only.

open-instruct accumulated by calling ``engine.backward()`` on several micro-batches before one ``engine.step()``,
with DeepSpeed configured for one accumulation step. DeepSpeed then treats every backward as an accumulation
boundary, and ZeRO-2's boundary reduces the gradient and makes it the partition ``step()`` uses, resetting what was
accumulated before: the update used the last micro-batch's gradient alone, where one process uses the gradient of
all of them. The fix calls ``set_gradient_accumulation_boundary()`` so that only the backward before ``step()`` is a
boundary and the earlier ones accumulate. This module re-creates DeepSpeed's engine arithmetic in torch-native code
around ``ZeroRedundancyOptimizer`` (ZeRO-1 over DDP): a micro-batch that is not a boundary runs under
``no_sync()`` and accumulates on its rank; a boundary's backward all-reduces and replaces the gradient partition
the optimizer will step on, clearing the accumulator.
"""

import contextlib

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("allenai/open-instruct", "pull", 1498, "zero",
          "engine.backward() per micro-batch with GAS=1: every backward a boundary, last micro-batch kept",
          fix_acts="gradient")

MICRO_BATCHES = 3  # each rank's 6 samples of block_stack's 12: micro-batches of 2


def zero(optimizer):
    """The team's ZeRO: the optimizer they were given, its state sharded over the ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # scripts optimizers with torch.jit on import

    return ZeroRedundancyOptimizer(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer),
                                   **optimizer.defaults)


class Engine:
    """DeepSpeed's engine, cut down to the accumulation boundary of ZeRO-2's backward epilogue."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.boundary = True  # with gradient_accumulation_steps=1, every backward is a boundary
        self.partition = None  # the reduced gradients step() uses (ZeRO-2's averaged_gradients)

    def set_gradient_accumulation_boundary(self, boundary):
        self.boundary = boundary

    def __call__(self, inputs):
        with contextlib.nullcontext() if self.boundary else self.model.no_sync():  # DDP reads it in forward
            return self.model(inputs)

    def backward(self, loss):
        loss.backward()
        if self.boundary:  # reduce and take the partition; the accumulator is reset
            self.partition = [p.grad for p in self.model.parameters()]
            self.model.zero_grad(set_to_none=True)

    def step(self):
        for p, grad in zip(self.model.parameters(), self.partition):
            p.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def train_step(model, optimizer, batch, marks_boundary=True):
    engine = Engine(model, optimizer)
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)  # each rank's sum over the global count, times W: DDP's average is the global mean
    for index, (x, y) in enumerate(zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES))):
        if marks_boundary:
            engine.set_gradient_accumulation_boundary(index == MICRO_BATCHES - 1)
        engine.backward(F.cross_entropy(engine(x), y, reduction="sum") * dist.get_world_size() / samples)
    engine.step()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, marks_boundary=False)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, optimizer_wrap=zero)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, optimizer_wrap=zero)
