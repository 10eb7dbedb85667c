"""verl-project/verl#5625: the legacy FSDP actor weighed token-mean micro-batch losses by their sequence counts.

verl's legacy FSDP worker (``dp_actor.update_policy``) hands the policy loss an empty ``config.global_batch_info``, so
``agg_loss`` with ``loss_agg_mode="token-mean"`` falls back to the micro-batch's own ``loss_mask.sum()`` and
``dp_size=1``: each micro-batch's loss is its own token mean. The actor then scales it for accumulation by
``loss_scale_factor``, a sequence ratio (``response_mask.shape[0] / ppo_mini_batch_size`` with dynamic batch sizes,
``1 / gradient_accumulation`` without), and FSDP averages the ranks' gradients. The issue's algebra: the accumulated
loss is the sum of ``sum_i / tokens_i * samples_i / total_samples``, not ``sum(sum_i) / total_tokens``. The fix it
proposes (pulls #5626 and #5877, after the new engine's own code) all-reduces the mini-batch's response tokens over
the ranks before the micro-batch loop and puts them in ``global_batch_info`` as ``batch_num_tokens`` with
``dp_size``, so ``agg_loss`` gives each micro-batch its slice of the global token mean, and drops the sequence-ratio
``loss_scale_factor``. Scaled down: the clipped surrogate on GRPO rollouts with 1 to 5 response tokens, 2 ranks
(DDP's mean stands in for FSDP's) of 6 sequences each, split by ``use_dynamic_bsz`` into micro-batches of at most 16
tokens (uneven in sequences and tokens), held to one process's token mean over the mini-batch.
"""

import contextlib
import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, PAD, all_reduced, masked_sum, pg_loss_mat, stepped, world_size

BUG = Bug("verl-project/verl", "issue", 5625, "accumulation",
          "legacy dp_actor: token-mean per micro-batch, scaled by its share of sequences (loss_scale_factor)",
          fix_acts="loss")

PPO_MINI_BATCH_SIZE = 6  # per GPU, as verl normalises it: each rank's 6 sequences are one mini-batch
PPO_MAX_TOKEN_LEN_PER_GPU = 16  # use_dynamic_bsz: the token budget of a micro-batch


def agg_loss(loss_mat, loss_mask, dp_size=1, batch_num_tokens=None):
    """verl's ``agg_loss`` for ``token-mean``: the masked sum over the global batch's tokens, times dp_size; without
    global batch info, over the micro-batch's own tokens."""
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size


def prepare_dynamic_batch(mini_batch, max_token_len):
    """Micro-batches of at most ``max_token_len`` tokens (the attention mask's): verl balances the sequences over
    as many micro-batches with Karmarkar-Karp; here consecutive sequences fill each budget in turn."""
    inputs, targets = mini_batch
    micro_batches, start, used = [], 0, 0
    for index, length in enumerate((inputs != PAD).sum(-1).tolist()):
        if used + length > max_token_len:
            micro_batches.append((inputs[start:index], targets[start:index]))
            start, used = index, 0
        used += length
    micro_batches.append((inputs[start:], targets[start:]))
    return micro_batches


def update_policy(model, optimizer, mini_batch, global_batch_info=True):
    _, targets = mini_batch
    config_global_batch_info = {}  # the legacy worker's: empty
    if global_batch_info:  # the fix: the mini-batch's response tokens over every rank, before the micro-batch loop
        config_global_batch_info = {"dp_size": world_size(), "batch_num_tokens": all_reduced(targets[..., MASK].sum())}

    micro_batches = prepare_dynamic_batch(mini_batch, PPO_MAX_TOKEN_LEN_PER_GPU)
    for index, (input_ids, micro_targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1  # the gradients reduced once, after the last micro-batch
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            pg_losses, response_mask = pg_loss_mat(model(input_ids), micro_targets)
            pg_loss = agg_loss(pg_losses, response_mask, **config_global_batch_info)  # compute_policy_loss_vanilla's
            if global_batch_info:
                loss = pg_loss  # agg_loss already holds the global context: no loss_scale_factor
            else:
                loss_scale_factor = response_mask.shape[0] / PPO_MINI_BATCH_SIZE  # relative to the dynamic bsz
                loss = pg_loss * loss_scale_factor
            loss.backward()
    stepped(optimizer)


update_policy_as_reported = functools.partial(update_policy, global_batch_info=False)


def buggy():
    return ec.check_step("field_rl_policy", update_policy_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", update_policy, world_size=2)
