"""tomhosking/torchseq#8: the micro-batches left at the end of an epoch, short of an optimizer batch, never stepped.

torchseq accumulated gradients over loader batches and called ``optimizer.step()`` only once the samples
accumulated since the last step reached ``optim_batch_size``. An epoch whose size is not a multiple of that left
its last micro-batches' gradients in ``.grad`` without a step, and the next epoch began with ``zero_grad()``: those
samples never trained the model. Training on the epoch's global batches steps on the last, smaller one too. The
fix forces a step on the leftover gradients at the end of the epoch. Each micro-batch's loss is weighted by its
size over ``optim_batch_size`` (the loss summed over samples, divided by the configured batch size), so the
reference here is a full-batch loop with that same normalisation: what is checked is that every sample is
stepped on, not how the last, smaller batch is weighted.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("tomhosking/torchseq", "issue", 8, "accumulation",
          "steps only once accumulated samples reach optim_batch_size: the epoch's leftover batches never step",
          fix_acts="optimizer")

OPTIM_BATCH_SIZE = 12
LOADER_BATCH_SIZE = 3  # 30 samples: 10 loader batches; steps after 4 and 8, the last 2 (6 samples) left over


def model():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def data():
    return torch.randn(30, 6), torch.randint(0, 3, (30,))


CASE = ec.register_case(ec.Case(
    name="field_torchseq_epoch_tail", model=model, data=data,
    loss=lambda logits, targets: F.cross_entropy(logits, targets, reduction="none"),
    batch_size=OPTIM_BATCH_SIZE, steps=3, last_batch="keep",
    description="30 samples: optimizer batches of 12, 12 and a leftover 6 (loader batches of 3)"))


def train_one_epoch(model, optimizer, loader, step_leftover=True):
    optimizer.zero_grad()
    steps_accum = 0
    for inputs, targets in loader:
        curr_batch_size = len(targets)
        # weight the loss by this batch's share of an optimizer batch, so the lr holds under accumulation
        loss = F.cross_entropy(model(inputs), targets) * curr_batch_size / OPTIM_BATCH_SIZE
        loss.backward()
        steps_accum += curr_batch_size
        if steps_accum >= OPTIM_BATCH_SIZE:
            optimizer.step()
            optimizer.zero_grad()
            steps_accum = 0
    if step_leftover and steps_accum > 0:  # the fix: the epoch's leftover gradients get their step
        optimizer.step()
        optimizer.zero_grad()


def train_loop(model, optimizer, batches, step_leftover=True):
    loader = DataLoader(batches.dataset, batch_size=LOADER_BATCH_SIZE)
    for _ in range(batches.epochs):
        train_one_epoch(model, optimizer, loader, step_leftover)


def train_loop_as_reported(model, optimizer, batches):
    train_loop(model, optimizer, batches, step_leftover=False)


def full_batch_loop(model, optimizer, batches):
    """The reference: one step on every global batch, the last smaller one included, each batch's loss summed
    over its samples and divided by optim_batch_size (torchseq's normalisation)."""
    for inputs, targets in batches:
        (F.cross_entropy(model(inputs), targets, reduction="sum") / OPTIM_BATCH_SIZE).backward()
        optimizer.step()
        optimizer.zero_grad()


def buggy():
    return ec.check_loop(CASE, train_loop_as_reported, reference=full_batch_loop)


def fixed():
    return ec.check_loop(CASE, train_loop, reference=full_batch_loop)
