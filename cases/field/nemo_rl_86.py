"""NVIDIA-NeMo/RL#86: the policy's gradients were summed over its micro-batches instead of averaged.

NeMo RL (then "reinforcer") trained its policy on a global batch split into micro-batches, backpropagating each
micro-batch's mean loss as it was, so the accumulated gradient was the sum of the micro-batch gradients: as many
times the global batch's mean gradient as there were micro-batches, an effective learning rate that grew with the
number of micro-batches a batch was cut into (issue #84). The pull, "gradient should be averaged instead of summed
across mbs", makes the accumulated gradient the average over the micro-batches, each micro-batch's loss divided by
their number before its backward (equal micro-batches: the average of their means is the global mean). Here the
team's step cuts mlp's global batch of 12 into 4 micro-batches of 3 and is held to one process taking the whole
batch's mean loss in one backward.
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("NVIDIA-NeMo/RL", "pull", 86, "accumulation",
          "policy gradients summed over micro-batches instead of averaged: num_microbatches times too big",
          fix_acts="loss")

NUM_MICROBATCHES = 4  # mlp's 12 samples a step: 4 micro-batches of 3


def train_step(model, optimizer, batch, average=True):
    inputs, targets = batch
    total = 0.0
    for x, y in zip(inputs.chunk(NUM_MICROBATCHES), targets.chunk(NUM_MICROBATCHES)):
        loss = F.cross_entropy(model(x), y)
        if average:  # the fix: each micro-batch's share of the average
            loss = loss / NUM_MICROBATCHES
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total if average else total / NUM_MICROBATCHES


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, average=False)


def buggy():
    return ec.check_step("mlp", train_step_as_reported)


def fixed():
    return ec.check_step("mlp", train_step)
