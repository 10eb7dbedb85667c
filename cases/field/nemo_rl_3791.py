"""NVIDIA-NeMo/RL#3791: VAPO's positive-example NLL was normalised by each micro-batch's own correct-sample tokens.

NeMo RL's ``ClippedPGLossFn`` implements VAPO's positive-example NLL term: the negative log-likelihood of the tokens of
correct samples (``rewards > 0``), weighted by ``positive_example_nll_weight``. Every other term of that loss is
normalised by ``global_valid_toks``, a count all-reduced over the data-parallel world before the loss is called, so
that the per-micro-batch losses the worker sums (and multiplies by ``dp_size`` against FSDP's mean) make one global
mean; the NLL term was ``masked_mean(-curr_logprobs, correct_mask, global_normalization_factor=correct_valid_toks)``
with ``correct_valid_toks`` the micro-batch's own count, a whole local mean on every micro-batch. The pull measured the
term's value at exactly 32.000 times its intended one for 32 micro-batches. The term is latent on main: the GRPO
batch carries no rewards until pull #3792 passes them. The pull, open, normalises the term by a global count; the run
as fixed here divides by the correct-sample tokens all-reduced over the ranks, VAPO's mean over every correct token
of the batch. Scaled down: the clipped surrogate on GRPO rollouts with outcome rewards of 1 or 0 and 1 to 5 response
tokens, the NLL weight 0.1, 2 ranks (DDP's mean stands in for FSDP's) with micro-batches of 3, held to the same loss
in one process over the whole batch, where the micro-batch's count is the batch's.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import (
    ACTION, BATCH_SIZE, MASK, REWARD, accumulate, all_reduced, pg_loss_mat, stepped, world_size,
)

BUG = Bug("NVIDIA-NeMo/RL", "pull", 3791, "accumulation",
          "VAPO positive-example NLL over the micro-batch's own correct tokens, summed over micro-batches",
          fixed_by="open; the NLL over the correct-sample tokens all-reduced over the ranks", fix_acts="loss")

TRAIN_MICRO_BATCH_SIZE = 3
POSITIVE_EXAMPLE_NLL_WEIGHT = 0.1


def masked_mean(values, mask, global_normalization_factor):
    return (values * mask).sum() / (global_normalization_factor + 1e-8)


def train_step(model, optimizer, batch, global_nll=True, micro_batch_size=TRAIN_MICRO_BATCH_SIZE):
    _, targets = batch
    global_valid_toks = all_reduced(targets[..., MASK].sum())
    global_correct_toks = all_reduced((targets[..., MASK] * (targets[..., REWARD] > 0)).sum())

    def loss_fn(model, inputs, targets):
        logits = model(inputs)
        clip_loss, mask = pg_loss_mat(logits, targets)
        actor_loss = masked_mean(clip_loss, mask, global_valid_toks)
        curr_logprobs = logits.log_softmax(-1).gather(-1, targets[..., ACTION].long().unsqueeze(-1)).squeeze(-1)
        correct_mask = mask * (targets[..., REWARD] > 0).to(mask.dtype)
        correct_valid_toks = correct_mask.sum()
        nll_loss = 0.0
        if correct_valid_toks > 0:
            nll_loss = masked_mean(-curr_logprobs, correct_mask,
                                   global_correct_toks if global_nll else correct_valid_toks)
        loss = actor_loss + POSITIVE_EXAMPLE_NLL_WEIGHT * nll_loss
        return loss * world_size()  # FSDP's mean over the DP ranks undone

    accumulate(model, batch, micro_batch_size, loss_fn)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, global_nll=False)
# The reference: the loss in one process over the whole batch, one micro-batch, whose own count is the batch's.
one_process = functools.partial(train_step, micro_batch_size=BATCH_SIZE)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported, one_process, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", train_step, one_process, world_size=2)
