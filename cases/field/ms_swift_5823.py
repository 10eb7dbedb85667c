"""modelscope/ms-swift#5823: the MoE aux loss was added whole to every micro-batch's token-normalised loss.

ms-swift's trainer adds ``router_aux_loss_coef * aux_loss`` to the language-model loss of each micro-batch. With
``num_items_in_batch`` the Trainer normalises the token losses by the real tokens of the whole accumulation window
and no longer divides by the accumulation steps, so each micro-batch's language-model loss is its share of the
window's mean; the aux loss, a mean over the micro-batch's own tokens, was added whole every time, and the window
summed it: the aux weighed ``gradient_accumulation_steps`` times its coefficient (the issue's runs logged losses in
the hundreds). The fix weights each micro-batch's aux loss by its share of the window's tokens, ``(labels != -100)
.sum() / num_items_in_batch``, which makes the window's aux the token-weighted mean. That is the whole batch's aux
where the aux is a mean over tokens; the toy's aux is the router z-loss, a mean over real tokens, since a batch-wise
balance loss of one micro-batch is no share of the whole batch's under any weighting.
"""

import functools

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import IGNORE, Z_WEIGHT, z_per_token

BUG = Bug("modelscope/ms-swift", "pull", 5823, "moe",
          "aux loss added whole to each micro-batch's loss over the window's tokens: GA times too heavy",
          fix_acts="loss")

GRADIENT_ACCUMULATION_STEPS = 3


def train_step(model, optimizer, batch, weight_by_tokens=True):
    inputs, labels = batch
    num_items_in_batch = (labels != IGNORE).sum()  # the accumulation window's real tokens
    for x, y in zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)):
        logits, scores, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss = loss / num_items_in_batch
        aux_loss = z_per_token(scores, y != IGNORE).mean()
        if weight_by_tokens:
            aux_loss = aux_loss * ((y != IGNORE).sum() / num_items_in_batch)
        (loss + Z_WEIGHT * aux_loss).backward()
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, weight_by_tokens=False)


def buggy():
    return ec.check_step("field_moe_z", train_step_as_reported)


def fixed():
    return ec.check_step("field_moe_z", train_step)
