"""huggingface/trl#3231: GRPO's loss was a token mean per device and per accumulation step, not invariant to placement.

TRL's ``GRPOTrainer.compute_loss`` (the normalisation of pull #2881) divided the masked per-token loss of the batch a
device holds by that batch's completion tokens, ``(per_token_loss * completion_mask).sum() / completion_mask.sum()``;
the ``Trainer`` divides the loss by the gradient-accumulation steps (``model_accepts_loss_kwargs = False``) and DDP
averages the devices' gradients. The pull's toy (``DDP=2``, ``per_device_train_batch_size=4``, a loss of 1 per token)
shows every token weighing equally only inside its own device: the step's loss, and which tokens count for how much,
depend on how the samples fall across devices and accumulation steps (issue #3021 had asked why GRPO got worse as
gradient accumulation grew). Gathering the token count over the devices would still leave the accumulation steps, so
the pull adds ``use_max_tokens_norm``: the loss sum over the constant ``max_tokens_norm =
per_device_train_batch_size * (max_prompt_length + max_completion_length)``, the same for every device and step. The
pull was closed for Dr. GRPO's loss (#3256), which divides by ``size(0) * max_completion_length`` the same way. The
reference is what the constant makes the objective: one process's token sum over the global batch's sequences times
that length. Scaled down: the clipped surrogate on GRPO rollouts (prompts of 1 to 3 tokens, responses of 1 to 5), 2
devices, ``per_device_train_batch_size=3`` with 2 accumulation steps, the run as fixed with the flag on.
"""

import dataclasses
import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import accumulate, pg_loss_mat, policy_case, stepped

BUG = Bug("huggingface/trl", "pull", 3231, "ddp",
          "GRPO loss / completion tokens per device and per GA step: token weights depend on sample placement",
          fix_acts="loss")

PER_DEVICE_TRAIN_BATCH_SIZE = 3
GRADIENT_ACCUMULATION_STEPS = 2  # each device's 6 sequences a step
MAX_PROMPT_LENGTH, MAX_COMPLETION_LENGTH = 3, 5


def max_tokens(targets):
    return len(targets) * (MAX_PROMPT_LENGTH + MAX_COMPLETION_LENGTH)


MAX_TOKENS_NORM = ec.register_case(dataclasses.replace(
    policy_case, name="field_rl_policy_max_tokens_norm", items=max_tokens,
    description="GRPO rollouts, the PPO surrogate's token sum over the global batch's sequences times the longest "
                "prompt plus completion: a constant normaliser"))


def training_step(model, optimizer, batch, use_max_tokens_norm=True):
    max_tokens_norm = PER_DEVICE_TRAIN_BATCH_SIZE * (MAX_PROMPT_LENGTH + MAX_COMPLETION_LENGTH)

    def compute_loss(model, inputs, targets):
        per_token_loss, completion_mask = pg_loss_mat(model(inputs), targets)
        if use_max_tokens_norm:
            loss = (per_token_loss * completion_mask).sum() / max_tokens_norm
        else:
            loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
        return loss / GRADIENT_ACCUMULATION_STEPS  # Trainer.training_step, model_accepts_loss_kwargs = False

    accumulate(model, batch, PER_DEVICE_TRAIN_BATCH_SIZE, compute_loss)
    stepped(optimizer)


training_step_as_reported = functools.partial(training_step, use_max_tokens_norm=False)


def buggy():
    return ec.check_step(MAX_TOKENS_NORM, training_step_as_reported, world_size=2)


def fixed():
    return ec.check_step(MAX_TOKENS_NORM, training_step, world_size=2)
