"""PrimeIntellect-ai/prime-rl#2562: each rank divided its token loss by its own token count before FSDP's mean.

In prime-rl's RL trainer every data-parallel rank computed a local ``loss_scale``, the number of loss-contributing
tokens it held, and divided its summed token loss by it before ``backward()``; FSDP then averaged the ranks'
gradients. Ranks hold sequences of different lengths, so the result was a mean of per-rank token means, not the
token mean of the whole batch: a token on a rank with few of them weighed more (issue #2358 measured the skew at
1.02 to 1.04 per step). The fix, mirroring the SFT trainer, all-reduces the token count over the ``dp_cp`` group
before the micro-batch loop, so every rank divides by the global count, and after the loop multiplies every
gradient by FSDP's gradient divide factor, turning FSDP's average into the sum over ranks. Here the team's step
trains the padded ``tokens`` case (uneven real tokens per rank) on 2 FSDP2 ranks, held to one process taking the
global batch's token mean.
"""

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import fully_sharded

BUG = Bug("PrimeIntellect-ai/prime-rl", "pull", 2562, "fsdp",
          "token loss divided by each rank's own token count, then FSDP's mean: a mean of rank means",
          fix_acts="loss")

IGNORE = -100


fsdp = fully_sharded  # the team's FSDP2 wrap: every layer with parameters, then the root


def train_step(model, optimizer, batch, global_tokens=True):
    inputs, targets = batch
    loss_scale = (targets != IGNORE).sum()
    if global_tokens:  # the fix: the token count over the dp group, before the micro-batch loop
        dist.all_reduce(loss_scale)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum") / loss_scale
    loss.backward()
    if global_tokens:  # and FSDP's average undone: the gradients summed over the ranks
        for parameter in model.parameters():
            parameter.grad.mul_(dist.get_world_size())
    optimizer.step()
    optimizer.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, global_tokens=False)


def buggy():
    return ec.check_step("tokens", train_step_as_reported, world_size=2, wrap=fsdp)


def fixed():
    return ec.check_step("tokens", train_step, world_size=2, wrap=fsdp)
