"""modelscope/FunASR#3472: under DDP, ``no_sync()`` skipped the all-reduce on the micro-batch before the step.

FunASR's trainer entered ``model.no_sync()`` whenever ``batch_idx % accum_grad != 0``: the first micro-batch of
each accumulation window all-reduced and every later one, the one before ``optimizer.step()`` included, stayed on
its rank. DDP averages what ``.grad`` holds at a syncing backward, so each rank stepped with the average of the first
micro-batch's gradients plus its own later ones: the ranks' replicas drifted apart and none trained on the global
batch. The fix tests ``(batch_idx + 1) % accum_grad``, so the window's last backward reduces the sum of all of them.
"""

import contextlib

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("modelscope/FunASR", "pull", 3472, "ddp",
          "no_sync() around every micro-batch but the first: the step's gradients never all-reduced whole",
          fix_acts="communication")

ACCUM_GRAD = 3  # each rank's 6 samples of mlp's 12: micro-batches of 2


def train_step(model, optimizer, batch, syncs=lambda index: (index + 1) % ACCUM_GRAD == 0):
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)  # the global batch's samples: each rank's sum over them, times W, averages to the mean
    for index, (x, y) in enumerate(zip(inputs.chunk(ACCUM_GRAD), targets.chunk(ACCUM_GRAD))):
        with contextlib.nullcontext() if syncs(index) else model.no_sync():
            (F.cross_entropy(model(x), y, reduction="sum") * dist.get_world_size() / samples).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, syncs=lambda index: index % ACCUM_GRAD == 0)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("mlp", train_step, world_size=2)
