"""huggingface/transformers#39659: the last, shorter accumulation window of an epoch was still divided by K.

The Trainer gathers up to ``gradient_accumulation_steps`` micro-batches for each optimizer step; at the end of an
epoch the last window may hold fewer. ``training_step`` divided every micro-batch's mean loss by
``gradient_accumulation_steps`` all the same, so a window of r < K micro-batches stepped with r/K of its mean
gradient (in the report, half of it). Training on that last, smaller global batch takes its plain mean. The fix
tracks how many micro-batches the current window really holds and divides by that count instead.
"""

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "pull", 39659, "accumulation",
          "the epoch's last, shorter accumulation window divided by the full gradient_accumulation_steps",
          fix_acts="loss")

GRADIENT_ACCUMULATION_STEPS = 4
PER_DEVICE_TRAIN_BATCH_SIZE = 3  # micro-batches of 3: global batches of 12, and a last one of 6 (2 micro-batches)


def model():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def data():
    return torch.randn(30, 6), torch.randint(0, 3, (30,))


CASE = ec.register_case(ec.Case(
    name="field_trainer_epoch_tail", model=model, data=data,
    loss=lambda logits, targets: F.cross_entropy(logits, targets, reduction="none"),
    batch_size=GRADIENT_ACCUMULATION_STEPS * PER_DEVICE_TRAIN_BATCH_SIZE, steps=3, last_batch="keep",
    description="30 samples: global batches of 12, 12 and 6 (micro-batches of 3: a last window of 2)"))


def get_batch_samples(batch):
    """The window of one optimizer step: up to K micro-batches (fewer at the end of the epoch)."""
    inputs, labels = batch
    return list(zip(inputs.split(PER_DEVICE_TRAIN_BATCH_SIZE), labels.split(PER_DEVICE_TRAIN_BATCH_SIZE)))


def train_loop(model, optimizer, batches, divide_by_window=True):
    losses = []
    for batch in batches:
        window = get_batch_samples(batch)
        current_gradient_accumulation_steps = len(window) if divide_by_window else GRADIENT_ACCUMULATION_STEPS
        total = 0.0
        for x, y in window:
            loss = F.cross_entropy(model(x), y) / current_gradient_accumulation_steps
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def train_loop_as_reported(model, optimizer, batches):
    return train_loop(model, optimizer, batches, divide_by_window=False)


def buggy():
    return ec.check_loop(CASE, train_loop_as_reported)


def fixed():
    return ec.check_loop(CASE, train_loop)
