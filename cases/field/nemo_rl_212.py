"""NVIDIA-NeMo/RL#212: each micro-batch's token-mean loss was divided by the count of micro-batches, empty ones too.

NeMo RL's policy worker computed the clipped policy-gradient loss of a micro-batch as ``masked_mean`` over that
micro-batch's valid tokens (``token_mask * sample_mask``), divided it by ``num_microbatches`` and backpropagated it,
and FSDP averaged the gradients over the data-parallel ranks. The issue: with a micro-batch size of 1 and a sample
masked out (its sequence exceeded ``max_seq_length``), that micro-batch has no valid token and adds nothing, yet still
counts in the denominator, so every other micro-batch is down-weighted; and a mean of micro-batch means weighs a token
of a short response above one of a long response. Pull #266 makes the loss functions token-level or sequence-level:
the worker counts the global batch's valid tokens (or sequences), all-reduces the count over the data-parallel group,
each micro-batch's loss is its masked sum over that count, the micro-batches' losses are summed, and the loss is
multiplied by ``dp_size`` to cancel FSDP's mean. Scaled down: the clipped surrogate on GRPO rollouts with 1 to 5
response tokens, two of the 24 samples masked whole, 2 data-parallel ranks (DDP's mean stands in for FSDP's) with
micro-batches of 1 sequence, held to one process's mean over the valid tokens of the global batch.
"""

import dataclasses
import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import (
    accumulate, all_reduced, pg_loss_mat, policy_case, policy_data, stepped, world_size,
)

BUG = Bug("NVIDIA-NeMo/RL", "issue", 212, "accumulation",
          "micro-batch token means / num_microbatches: empty (masked) micro-batches counted, tokens unequal",
          fixed_by="pull #266", fix_acts="loss")

TRAIN_MICRO_BATCH_SIZE = 1
TOO_LONG = (4, 15)  # the samples masked for exceeding max_seq_length: sample_mask 0


def cut_rollouts():
    return policy_data(masked=TOO_LONG)


CUT = ec.register_case(dataclasses.replace(
    policy_case, name="field_rl_policy_cut", data=cut_rollouts,
    description="GRPO rollouts with two samples masked whole (sample_mask 0): the mean over the valid tokens"))


def masked_mean(values, mask, global_normalization_factor=None):
    """NeMo RL's ``masked_mean``: over the mask's own count, or over a global one (the pull's argument)."""
    normalization_factor = mask.sum() if global_normalization_factor is None else global_normalization_factor
    return (values * mask).sum() / (normalization_factor + 1e-8)


def train_step(model, optimizer, batch, global_normalization=True):
    inputs, targets = batch
    num_microbatches = len(inputs) // TRAIN_MICRO_BATCH_SIZE
    total_valid_tokens = all_reduced(targets[..., 0].sum()) if global_normalization else None

    def loss_fn(model, inputs, targets):
        clip_loss, mask = pg_loss_mat(model(inputs), targets)
        actor_loss = masked_mean(clip_loss, mask, total_valid_tokens)
        if global_normalization:
            return actor_loss * world_size()  # cancel FSDP's mean over the DP ranks
        return actor_loss / num_microbatches  # accumulated across micro-batches: scaled by their number

    accumulate(model, batch, TRAIN_MICRO_BATCH_SIZE, loss_fn)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, global_normalization=False)


def buggy():
    return ec.check_step(CUT, train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step(CUT, train_step, world_size=2)
