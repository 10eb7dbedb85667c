"""modelscope/ms-swift#10117: the DAPO loss, already over the window's tokens, was divided again by the GA steps.

For ``loss_type`` ``dapo`` (``cispo`` and ``fipo`` alike) ms-swift's GRPO trainer normalises the policy loss by the
completion tokens of the whole gradient-accumulation window: ``normalizer = num_items_in_batch / num_processes`` and
``loss = (per_token_loss * completion_mask).sum() / normalizer``, ``num_items_in_batch`` gathered over every
micro-batch of the window on every process, so one micro-batch's loss is already its slice of the global token mean
(DDP's mean over the processes undone by the ``/ num_processes``). ``transformers.Trainer.training_step`` then divided
the loss by ``current_gradient_accumulation_steps`` before backward, as it does for a loss that is a micro-batch's
mean, so the gradient was g / G for G accumulation steps: the effective learning rate fell as G grew (the issue's
minimal check is ``(loss / 4).backward()``). Pull #10116 undoes the Trainer's scaling for these three loss types, the
window-normalised policy loss multiplied by the accumulation steps so that the Trainer's division cancels. Scaled
down: the clipped surrogate on GRPO rollouts with 1 to 5 response tokens, 2 processes with 2 accumulation steps of 3
sequences each, held to one process's token mean over the window.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, accumulate, all_reduced, pg_loss_mat, stepped, world_size

BUG = Bug("modelscope/ms-swift", "issue", 10117, "accumulation",
          "DAPO loss over the window's tokens / num_processes, divided again by GA steps in training_step",
          fixed_by="pull #10116", fix_acts="loss")

PER_DEVICE_TRAIN_BATCH_SIZE = 3
GRADIENT_ACCUMULATION_STEPS = 2  # each process's 6 sequences a step


def train_step(model, optimizer, batch, undo_trainer_scaling=True):
    _, targets = batch
    num_items_in_batch = all_reduced(targets[..., MASK].sum())  # the window's completion tokens, every process
    num_processes = world_size()

    def training_step(model, inputs, targets):
        per_token_loss, completion_mask = pg_loss_mat(model(inputs), targets)
        normalizer = num_items_in_batch / num_processes
        loss = (per_token_loss * completion_mask).sum() / normalizer
        if undo_trainer_scaling:  # the fix: the window-normalised loss times GA, so the Trainer's divide cancels
            loss = loss * GRADIENT_ACCUMULATION_STEPS
        return loss / GRADIENT_ACCUMULATION_STEPS  # Trainer.training_step: / current_gradient_accumulation_steps

    accumulate(model, batch, PER_DEVICE_TRAIN_BATCH_SIZE, training_step)
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, undo_trainer_scaling=False)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", train_step, world_size=2)
