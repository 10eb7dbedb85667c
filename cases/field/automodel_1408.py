"""NVIDIA-NeMo/Automodel#1408: the MoE aux loss's gradient never reached the router.

Automodel's MoE gate computes the load-balancing loss and attaches it to the layer's output with Megatron's
``MoEAuxLossAutoScaler``: an autograd function whose forward returns its input unchanged and whose backward hands the
aux loss a gradient of ``main_loss_backward_scale``, so the aux is differentiated with the main loss. The gate called
``MoEAuxLossAutoScaler.apply(weights, aux_loss)`` and discarded what it returned; the autograd node was never on the
path of the loss, so the aux loss was computed every step and never differentiated, and the router learned from the
language-model loss alone. The report's fix keeps the returned tensor and applies the coefficient
(``weights = MoEAuxLossAutoScaler.apply(weights, aux_loss_coeff * aux_loss)``). Here the scaler is attached to the
model's logits; under DDP each rank's aux is the mean over its own sequences, and DDP's average makes it the global
batch's.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import BALANCE_WEIGHT, IGNORE, PAD, sequence_balance

BUG = Bug("NVIDIA-NeMo/Automodel", "issue", 1408, "moe",
          "MoEAuxLossAutoScaler.apply's return value discarded: the aux loss never differentiated",
          fixed_by="pull #1412", fix_acts="loss")


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Megatron's: the output as it is forward; the aux loss given ``main_loss_backward_scale`` as its gradient."""

    main_loss_backward_scale = 1.0

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * MoEAuxLossAutoScaler.main_loss_backward_scale


def train_step(model, optimizer, batch, keep_returned=True):
    inputs, labels = batch
    num_label_tokens = (labels != IGNORE).sum()
    dist.all_reduce(num_label_tokens)
    logits, scores, slots = model(inputs)
    aux_loss = sequence_balance(scores, slots, inputs != PAD).mean()
    if keep_returned:
        logits = MoEAuxLossAutoScaler.apply(logits, BALANCE_WEIGHT * aux_loss)
    else:
        MoEAuxLossAutoScaler.apply(logits, aux_loss)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    (loss / num_label_tokens * dist.get_world_size()).backward()
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, keep_returned=False)


def buggy():
    return ec.check_step("field_moe", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_moe", train_step, world_size=2)
