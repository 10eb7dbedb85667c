"""karpathy/nanoGPT#168: each micro-batch's mean loss was backpropagated without dividing by the accumulation steps.

nanoGPT's training loop split a global batch into ``gradient_accumulation_steps`` micro-batches and called
``loss.backward()`` on each one's mean loss as it was. The gradients of K means add up to K times the gradient of
the global batch's mean, so every update was K times too large: a silently raised learning rate that changes
whenever the accumulation count does. The fix divides each micro-batch's loss by the number of accumulation steps
before its backward (equal micro-batches: the mean of the means is the global mean).
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("karpathy/nanoGPT", "issue", 168, "accumulation",
          "micro-batch mean losses backpropagated without / accumulation steps", fixed_by="commit 553f949",
          fix_acts="loss")

ACCUMULATION_STEPS = 4  # mlp's 12 samples a step: 4 equal micro-batches of 3


def train_step(model, optimizer, batch, scale=1 / ACCUMULATION_STEPS):
    inputs, targets = batch
    for x, y in zip(inputs.chunk(ACCUMULATION_STEPS), targets.chunk(ACCUMULATION_STEPS)):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, scale=1)


def buggy():
    return ec.check_step("mlp", train_step_as_reported)


def fixed():
    return ec.check_step("mlp", train_step)
