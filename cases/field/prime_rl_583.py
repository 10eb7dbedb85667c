"""PrimeIntellect-ai/prime-rl#583: each micro-batch's loss was normalised by its own token count, not the batch's.

prime-rl's trainer summed the masked per-token GRPO loss of a micro-batch and divided it by ``max_tokens``, with
``normalize_to_token_count`` on the micro-batch's ``total_tokens`` (the sum of its samples' lengths), then divided by
``num_micro_batches`` before backward. The pull states the flaw: with micro-batch values x_i and normalisers c_i
adding up to c, the batch's normalised average is the sum of x_i / (n c), and the code computed the sum of x_i / (n
c_i), which is not the same, so a micro-batch of short sequences weighed as much as one of long sequences. The pull
(merged as "Fix loss normalization") makes the loss a masked sum and divides every micro-batch's loss by one
``loss_scale``, the loss-mask tokens of all the step's micro-batches, with no division by their number; the count is
still this rank's own, which a later report (#2562, its own row) took on across the FSDP ranks. Scaled down: the
clipped surrogate on GRPO rollouts with prompts of 1 to 3 tokens and responses of 1 to 5, in one process, 4
micro-batches of 3 sequences per step, held to the token mean over the step's response tokens.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, PAD, accumulate, masked_sum, pg_loss_mat, stepped

BUG = Bug("PrimeIntellect-ai/prime-rl", "pull", 583, "accumulation",
          "micro-batch loss sum / its own total_tokens / num_micro_batches: sum x_i/(n c_i), not x_i/(n c)",
          fix_acts="loss")

MICRO_BATCH_SIZE = 3


def train_step(model, optimizer, batch, batch_normalized=True):
    inputs, targets = batch
    num_micro_batches = -(-len(inputs) // MICRO_BATCH_SIZE)
    loss_scale = targets[..., MASK].sum()  # the loss-mask tokens of every micro-batch of the step

    def micro_batch_loss(model, input_ids, targets):
        per_token_loss, loss_mask = pg_loss_mat(model(input_ids), targets)
        if batch_normalized:
            return masked_sum(per_token_loss, loss_mask) / loss_scale
        max_tokens = (input_ids != PAD).sum()  # normalize_to_token_count: the micro-batch's total_tokens
        return masked_sum(per_token_loss, loss_mask) / max_tokens / num_micro_batches

    accumulate(model, batch, MICRO_BATCH_SIZE, micro_batch_loss)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, batch_normalized=False)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported)


def fixed():
    return ec.check_step("field_rl_policy", train_step)
