"""Lightning-AI/pytorch-lightning#9599: with native AMP the gradients were clipped before the GradScaler unscaled them.

Lightning's native mixed-precision plugin back-propagated ``scaler.scale(loss)``, so ``.grad`` held the gradient
times the loss scale S (2**16 to start). Gradient clipping ran right after the backward, and ``scaler.unscale_``
only later, in the hook before the optimizer step: the clip measured S times the true norm, so any
``gradient_clip_val`` was exceeded and, once unscaled, the step used a gradient of norm ``gradient_clip_val / S``, a
nearly flat learning curve. Training in full precision clips the true gradient once before the step. The fix
moved ``unscale_`` to a hook that runs before gradient clipping (and grad-norm tracking).
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once

BUG = Bug("Lightning-AI/pytorch-lightning", "issue", 9599, "accumulation",
          "clip_grad_norm_ on gradients still multiplied by the GradScaler's scale", fixed_by="pull #9606",
          fix_acts="gradient")

ACCUMULATE_GRAD_BATCHES = 4  # mlp's 12 samples a step: 4 equal micro-batches of 3
GRADIENT_CLIP_VAL = 0.1  # below the true gradient's norm at every step of mlp: the reference clips too


class NativeMixedPrecisionPlugin:
    """The plugin's part of a step: the scaled backward, unscaling before the step, the scaler's step and update.
    (On CPU in float64 there is no autocast to apply; the GradScaler's arithmetic is the part that matters.)"""

    def __init__(self):
        self.scaler = torch.amp.GradScaler("cpu")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer):
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer):
        self.scaler.step(optimizer)
        self.scaler.update()


def make_train_step(unscale_before_clipping=True):
    plugin = NativeMixedPrecisionPlugin()  # one per run: the scaler keeps its scale across steps

    def train_step(model, optimizer, batch):
        inputs, targets = batch
        for x, y in zip(inputs.chunk(ACCUMULATE_GRAD_BATCHES), targets.chunk(ACCUMULATE_GRAD_BATCHES)):
            plugin.backward(F.cross_entropy(model(x), y) / ACCUMULATE_GRAD_BATCHES)
        if unscale_before_clipping:
            plugin.unscale(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRADIENT_CLIP_VAL)
        if not unscale_before_clipping:  # pre_optimizer_step: too late, the clip has seen S * g
            plugin.unscale(optimizer)
        plugin.optimizer_step(optimizer)
        optimizer.zero_grad()

    return train_step


def make_train_step_as_reported():
    return make_train_step(unscale_before_clipping=False)


clipped_full_batch = clipped_once(GRADIENT_CLIP_VAL)


def buggy():
    return ec.check_step("mlp", make_train_step_as_reported, reference=clipped_full_batch, per_run=True)


def fixed():
    return ec.check_step("mlp", make_train_step, reference=clipped_full_batch, per_run=True)
