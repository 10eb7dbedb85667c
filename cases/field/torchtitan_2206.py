"""pytorch/torchtitan#2206: the loss was normalised per micro-batch and per rank, not by the global valid tokens.

Before this pull torchtitan's cross-entropy took the mean over each micro-batch's valid (non-ignored) tokens,
``rescale_accumulated_loss`` divided it by the gradient-accumulation steps, and FSDP averaged the ranks' gradients:
the objective was a mean of micro-batch means over the ranks. Where micro-batches or ranks hold different numbers
of valid tokens (padding, SFT prompts masked with the ignore index) a token in a sparse micro-batch weighed more
than one in a dense one, which full-batch training does not do (issue #1842). The fix switches the loss to a sum,
counts the valid tokens of all the step's micro-batches on all data-parallel ranks before accumulation starts,
divides every micro-batch's sum by that global count, and turns FSDP's gradient averaging off (divide factor 1), so
the ranks' gradients add up to the global token mean's. Here the team's step trains the padded ``tokens`` case on 2
FSDP2 ranks with 2 micro-batches each, FSDP reducing after every micro-batch as torchtitan's does, against one
process taking the global batch's token mean.
"""

import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import fully_sharded

BUG = Bug("pytorch/torchtitan", "pull", 2206, "accumulation",
          "token loss averaged per micro-batch / GA steps and per rank, not over the global valid tokens",
          fix_acts="loss")

IGNORE = -100
GRADIENT_ACCUMULATION_STEPS = 2  # each rank's 6 sequences: micro-batches of 3


def fsdp(model, divide=True):
    """The team's FSDP2 wrap; the fix (``disable_fsdp_gradient_division``) sets every divide factor to 1."""
    model = fully_sharded(model)
    if not divide:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
    return model


def fsdp_summing(model):
    return fsdp(model, divide=False)


def cross_entropy_loss(pred, labels, reduction):
    return F.cross_entropy(pred.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction=reduction)


def train_step(model, optimizer, batch, global_tokens=True):
    inputs, labels = batch
    micro_batches = list(zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)))
    global_valid_tokens = (labels != IGNORE).sum().double()  # every micro-batch of the step, then every rank
    dist.all_reduce(global_valid_tokens)
    total = 0.0
    for x, y in micro_batches:
        if global_tokens:  # the fix: a sum over the global valid tokens
            loss = cross_entropy_loss(model(x), y, "sum") / global_valid_tokens
        else:  # as reported: the micro-batch's token mean, rescaled by the accumulation steps
            loss = cross_entropy_loss(model(x), y, "mean") / GRADIENT_ACCUMULATION_STEPS
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    if global_tokens:
        dist.all_reduce(total)
        return total


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, global_tokens=False)


def buggy():
    return ec.check_step("tokens", train_step_as_reported, world_size=2, wrap=fsdp,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)


def fixed():
    return ec.check_step("tokens", train_step, world_size=2, wrap=fsdp_summing,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)
