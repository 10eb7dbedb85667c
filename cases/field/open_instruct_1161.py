"""allenai/open-instruct#1161: grpo_fast took a token mean per micro-batch and divided it by the accumulation steps.

``grpo_fast`` trains on packed sequences, one pack per micro-batch (``per_device_train_batch_size=1``), accumulating
``accumulation_steps`` of them before ``model.step()``. Each micro-batch's loss was ``masked_mean(pg_loss_max,
response_mask)``, its own tokens' mean, then ``loss / accumulation_steps``, and DeepSpeed averaged the gradients over
the ranks: each pack weighed the same whatever its number of response tokens, a sample-wise weighting instead of the
token-level loss intended (the closed pull #1137 quotes the report: with a real batch size of 1, averaging over the
accumulated items makes the loss sample-wise). Pull #1161 adds ``calculate_token_counts``: every micro-batch's
response-token count, all-reduced over the ranks and summed per accumulation group; each micro-batch's loss is its
masked sum over its group's count (``loss_denominator="token"``, the new default), no longer divided by the
accumulation steps but multiplied by the world size, since the count already spans every rank. Scaled down: the
clipped surrogate on GRPO rollouts with 1 to 5 response tokens, each sequence a micro-batch (a pack of one), 2 ranks
(DDP's mean stands in for DeepSpeed's) of 6 micro-batches per optimizer step, held to one process's mean over the
response tokens of the global batch.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, accumulate, all_reduced, pg_loss_mat, stepped, world_size

BUG = Bug("allenai/open-instruct", "pull", 1161, "accumulation",
          "grpo_fast: masked_mean per packed micro-batch / accumulation_steps: packs weighed, not tokens",
          fix_acts="loss")

PER_DEVICE_TRAIN_BATCH_SIZE = 1


def masked_mean(values, mask, axis=None, denominator=None):
    """open-instruct's ``masked_mean`` (axis None): the sum over the mask, over its count or a given denominator."""
    numerator = (values * mask).sum()
    denom = mask.sum() if denominator is None else denominator
    return numerator / denom


def calculate_token_counts(targets):
    """The accumulation group's response tokens, summed over every rank (one group per optimizer step here)."""
    local_counts = [micro[..., MASK].sum() for micro in targets.split(PER_DEVICE_TRAIN_BATCH_SIZE)]
    return all_reduced(sum(local_counts))


def train_step(model, optimizer, batch, loss_denominator="token"):
    inputs, targets = batch
    accumulation_steps = len(inputs) // PER_DEVICE_TRAIN_BATCH_SIZE
    denominator = calculate_token_counts(targets) if loss_denominator == "token" else None

    def loss_of(model, inputs, targets):
        pg_loss_max, response_mask = pg_loss_mat(model(inputs), targets)
        loss = masked_mean(pg_loss_max, response_mask, None, denominator)
        if loss_denominator == "token":
            return loss * world_size()  # we already took world size into account via the tokens
        return loss / accumulation_steps

    accumulate(model, batch, PER_DEVICE_TRAIN_BATCH_SIZE, loss_of)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, loss_denominator=None)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", train_step, world_size=2)
