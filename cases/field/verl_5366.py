"""verl-project/verl#5366: Dr. GRPO's seq-mean-token-sum-norm loss was not multiplied by dp_size against FSDP's mean.

verl's ``agg_loss`` is written to be invariant to parallelism: its ``token-mean`` and ``seq-mean`` modes divide each
micro-batch's masked sum by a global count (tokens, sequences) and multiply by ``dp_size``, because FSDP averages the
gradients over the data-parallel ranks where the objective needs their sum. The ``seq-mean-token-sum-norm`` mode
(Dr. GRPO: every token's loss summed and divided by a constant ``loss_scale_factor``, to avoid the length bias) did
only the division, ``torch.sum(seq_losses) / loss_scale_factor``. Under FSDP's mean each rank's sum then counted
1/dp_size of its share, so the step was dp_size times smaller than one process's on the same mini-batch. In review the
pull's author pointed to FSDP's mean reduce-scatter as the reason, and the maintainers agreed that ``agg_loss`` must be
parallelism-invariant; the pull multiplies by ``dp_size`` (and now raises where the global information or the
scale factor is missing). Scaled down: the PPO surrogate on GRPO rollouts with 1 to 5 response tokens, 2 data-parallel
ranks (DDP's mean stands in for FSDP's), 2 micro-batches each, ``loss_scale_factor`` the response length, held to the
same loss on the whole mini-batch in one process.
"""

import functools

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import BATCH_SIZE, LENGTH, accumulate, pg_loss_mat, stepped, world_size

BUG = Bug("verl-project/verl", "pull", 5366, "ddp",
          "seq-mean-token-sum-norm: token sum / loss_scale_factor, no * dp_size against FSDP's mean over ranks",
          fix_acts="loss")

MICRO_BATCH_SIZE = 3
LOSS_SCALE_FACTOR = LENGTH  # the configured constant: the response length, agg_loss's old default


def agg_loss(loss_mat, loss_mask, dp_size, cancels_dp_mean=True):
    """``agg_loss`` for ``seq-mean-token-sum-norm``, as the pull left it (and as it was before: no dp_size)."""
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    loss = torch.sum(seq_losses) / LOSS_SCALE_FACTOR
    return loss * dp_size if cancels_dp_mean else loss


def train_step(model, optimizer, batch, cancels_dp_mean=True, micro_batch_size=MICRO_BATCH_SIZE):
    dp_size = world_size()

    def policy_loss(model, inputs, targets):
        return agg_loss(*pg_loss_mat(model(inputs), targets), dp_size, cancels_dp_mean)

    accumulate(model, batch, micro_batch_size, policy_loss)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, cancels_dp_mean=False)
# The reference: the same loss in one process (dp_size 1) over the whole mini-batch at once.
one_process = functools.partial(train_step, micro_batch_size=BATCH_SIZE)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported, one_process, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", train_step, one_process, world_size=2)
