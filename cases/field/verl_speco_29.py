"""verl-project/verl-SpeCo#29: the drafter loss's global token mean went through a plain all-reduce, then FSDP's mean.

The drafter trainer's ``_training_step_on_batch`` all-reduced each rank's summed token loss and its token count,
divided the one by the other and called ``backward()`` on that value. ``dist.all_reduce`` is not differentiable, so
each rank's backward carried only its own tokens' loss over the global token count, which is already its share of
the global mean; FSDP then averaged the ranks' gradients on top, and the synchronised gradient came out divided by
the world size: a W-rank run trained at ``lr / W`` and its results moved with the number of ranks (early on the
clip at norm 1.0 hid it). The fix keeps the all-reduced sums for the skip guards and logging only, detached, and
runs backward on this rank's own loss sum times the world size over the global token count, so FSDP's mean gives
the global token mean's gradient exactly. Here the team's step trains the padded ``tokens`` case on 2 FSDP2 ranks
(uneven real tokens per rank) against one process taking the global batch's token mean.
"""

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import fully_sharded

BUG = Bug("verl-project/verl-SpeCo", "pull", 29, "fsdp",
          "loss all-reduced (not autograd) / global tokens, then FSDP's mean: grads divided by world size",
          fix_acts="loss")

IGNORE = -100


fsdp = fully_sharded  # the team's FSDP2 wrap: every layer with parameters, then the root


def loss_sums(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss_sum, (targets != IGNORE).sum().to(loss_sum.dtype)


def train_step_as_reported(model, optimizer, batch):
    """The summed loss and token count all-reduced, their ratio backpropagated."""
    loss_sum, tokens = loss_sums(model, batch)
    dist.all_reduce(loss_sum)
    dist.all_reduce(tokens)
    loss = loss_sum / tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    """The fix: the reduced sums (detached) for metrics; backward on the local sum x W / global tokens."""
    loss_sum, tokens = loss_sums(model, batch)
    reduced_loss, global_tokens = loss_sum.detach().clone(), tokens.clone()
    dist.all_reduce(reduced_loss)
    dist.all_reduce(global_tokens)
    loss = loss_sum * dist.get_world_size() / global_tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return reduced_loss / global_tokens


def buggy():
    return ec.check_step("tokens", train_step_as_reported, world_size=2, wrap=fsdp)


def fixed():
    return ec.check_step("tokens", train_step, world_size=2, wrap=fsdp)
