"""huggingface/transformers#48690: the Trainer multiplied the MoE router's aux loss by the world size with the LM loss.

With ``average_tokens_across_devices=True`` the Trainer hands the model the token count summed over the ranks
(``num_items_in_batch``), so each rank's cross-entropy is its share of the global mean, and multiplies the loss by
the world size to undo DDP's averaging of the gradients. Qwen3-MoE's loss already holds the router's aux loss,
``router_aux_loss_coef * aux_loss``, a mean over the rank's own batch, which DDP's averaging alone turns into the
mean over the global batch: multiplied with the rest, the aux weighed ``world_size`` times its coefficient, and moving
one batch from one rank to two changed the router's gradient. The proposed fix (pull #48691, open) multiplies only
the cross-entropy. The toy's aux is the sequence-wise balance loss (a mean over the rank's sequences), so that the
ranks' average is the whole batch's.
"""

import functools

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import BALANCE_WEIGHT, IGNORE, PAD, sequence_balance

BUG = Bug("huggingface/transformers", "issue", 48690, "moe",
          "loss times world size under average_tokens_across_devices, the router's aux loss included",
          fixed_by="pull #48691 (open)", fix_acts="loss")

ROUTER_AUX_LOSS_COEF = BALANCE_WEIGHT


def train_step(model, optimizer, batch, scale_aux_too=False):
    inputs, labels = batch
    num_items_in_batch = (labels != IGNORE).sum()
    dist.all_reduce(num_items_in_batch)  # average_tokens_across_devices
    logits, scores, slots = model(inputs)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    ce = ce / num_items_in_batch
    aux_loss = sequence_balance(scores, slots, inputs != PAD).mean()
    loss = ce + ROUTER_AUX_LOSS_COEF * aux_loss  # the model's loss, as Qwen3-MoE returns it
    if scale_aux_too:
        loss = loss * dist.get_world_size()
    else:
        loss = ce * dist.get_world_size() + ROUTER_AUX_LOSS_COEF * aux_loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, scale_aux_too=True)


def buggy():
    return ec.check_step("field_moe", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_moe", train_step, world_size=2)
