"""PrimeIntellect-ai/prime-rl#2267: a per-micro-batch stats call zeroed the routed-token counts the bias update reads.

The pull adds aux-loss-free load balancing to prime-rl's SFT trainer: ``update_expert_bias`` runs once per optimizer
step, after the micro-batch loop, and moves each MoE layer's ``expert_bias`` by ``load_balance_coeff * sign(mean -
tokens_per_expert)`` from the counts the forwards accumulated. But the training loop already called
``get_load_balance_stats(model)`` after every micro-batch's backward, for its max-violation metric, and that call
zeroes ``tokens_per_expert`` by default (``reset_stats=True``). It runs after the last micro-batch too, so the
update, after the loop, would read counts of zero and never move the bias, whatever the number of micro-batches.
The same pull passes ``reset_stats=False`` there, so the counts accumulate over the micro-batches and are zeroed by
the update itself. The row checks the pull's step with and without that argument (the bug is the one the pull names
and fixes in its own change), each against the same step on the whole batch: the bias is a buffer, compared as the
weights are, but a bias that never moves on the whole batch either is no difference between two runs.
"""

import functools

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import IGNORE

BUG = Bug("PrimeIntellect-ai/prime-rl", "pull", 2267, "moe",
          "per-micro-batch stats call zeroed tokens_per_expert before the bias update read it",
          known_miss="the stats call zeroes the counts after every micro-batch, the last included, so the bias "
                     "never moves, on the whole batch as under 3 micro-batches (measured: expert_bias stays 0 after a "
                     "step): the team's step agrees with itself on the whole batch. Held to the fixed step on the "
                     "whole batch instead (a reference that moves the bias) it is caught, margin 2e4; a check that "
                     "the bias moved at all is a check of the code against itself, not of two runs",
          fix_acts="state")

LOAD_BALANCE_COEFF = 1e-3
GRAD_ACCUM_STEPS = 3


def get_load_balance_stats(model, reset_stats=True):
    """prime-rl's stats: the max violation of the counts so far, which it zeroes unless told not to."""
    counts = model.tokens_per_expert
    max_vio = (counts.max() - counts.mean()) / counts.mean().clamp(min=1)
    if reset_stats:
        counts.zero_()
    return {"max_vio": max_vio}


def update_expert_bias(model):
    """prime-rl's ``update_expert_bias``, once per optimizer step (one process: no counts to all-reduce)."""
    with torch.no_grad():
        tokens_per_expert = model.tokens_per_expert
        if tokens_per_expert.sum() > 0:
            model.expert_bias.add_(LOAD_BALANCE_COEFF * torch.sign(tokens_per_expert.mean() - tokens_per_expert))
        tokens_per_expert.zero_()


def train_step(model, optimizer, batch, grad_accum_steps=GRAD_ACCUM_STEPS, reset_stats=False):
    tokens, labels = batch
    num_tokens = (labels != IGNORE).sum()
    batch_max_vio = 0.0
    for x, y in zip(tokens.chunk(grad_accum_steps), labels.chunk(grad_accum_steps)):
        logits, _, _ = model(x)
        lm_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        (lm_loss / num_tokens).backward()
        batch_max_vio += get_load_balance_stats(model, reset_stats=reset_stats)["max_vio"] / grad_accum_steps
    update_expert_bias(model)
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, reset_stats=True)
whole_batch = functools.partial(train_step, grad_accum_steps=1)
whole_batch_as_reported = functools.partial(train_step, grad_accum_steps=1, reset_stats=True)


def buggy():
    return ec.check_step("field_moe_bias", train_step_as_reported, reference=whole_batch_as_reported)


def fixed():
    return ec.check_step("field_moe_bias", train_step, reference=whole_batch)
