"""verl-project/verl#6957: the critic's token-mean value loss was normalised per micro-batch, not per mini-batch.

After verl's engine refactor the actor's ``ppo_loss`` handed ``agg_loss`` the global batch information (``dp_size``,
``batch_num_tokens``, ``global_batch_size``), so its micro-batch losses are slices of the mini-batch's token mean, but
the critic's ``value_loss`` called ``compute_value_loss`` and ``agg_loss`` without it. For ``token-mean``
``agg_loss`` then fell back to the micro-batch's own ``loss_mask.sum()`` and ``dp_size=1``: every micro-batch a whole
mean, and the engine sums the micro-batches' losses, so the critic's gradient was about K times the mini-batch's
token mean for K micro-batches (the pull measured 2.05x at K=2, 4.06x at K=4) and moved with the micro-batch split.
The fix forwards ``dp_size``, the all-reduced ``batch_num_tokens`` and ``global_batch_size`` from the batch to
``compute_value_loss``, which hands them on to ``agg_loss``: each micro-batch's masked sum over the mini-batch's tokens,
times ``dp_size`` against FSDP's mean over ranks. Scaled down: a tiny value model on GRPO-style rollouts with 1 to 5
response tokens, 2 data-parallel ranks (DDP's mean stands in for FSDP's), each rank's 6 sequences in 2 micro-batches
of 3, the clipped value loss as ``compute_value_loss`` writes it, held to one process's token mean over the whole
mini-batch.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import accumulate, all_reduced, masked_sum, stepped, value_loss_mat, world_size

BUG = Bug("verl-project/verl", "pull", 6957, "accumulation",
          "critic value_loss called agg_loss without global batch info: token-mean per micro-batch, summed",
          fix_acts="loss")

MICRO_BATCH_SIZE = 3  # ppo_micro_batch_size_per_gpu: each rank's 6 sequences in 2 micro-batches


def agg_loss(loss_mat, loss_mask, dp_size=1, batch_num_tokens=None):
    """verl's ``agg_loss`` for ``token-mean``: a masked sum over the global tokens, times dp_size; without them,
    the micro-batch's own tokens."""
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size


def train_step(model, optimizer, batch, global_batch_info=True):
    _, targets = batch
    info = {}
    if global_batch_info:  # the engine's count before the micro-batch split, all-reduced over DP
        info = {"dp_size": world_size(), "batch_num_tokens": all_reduced(targets[..., 0].sum())}

    def value_loss(model, inputs, micro_targets):
        clipped_vf_losses, response_mask = value_loss_mat(model(inputs), micro_targets)
        return 0.5 * agg_loss(clipped_vf_losses, response_mask, **info)

    accumulate(model, batch, MICRO_BATCH_SIZE, value_loss)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, global_batch_info=False)


def buggy():
    return ec.check_step("field_rl_critic", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_rl_critic", train_step, world_size=2)
