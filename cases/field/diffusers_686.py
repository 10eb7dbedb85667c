"""huggingface/diffusers#686: the DreamBooth script unscaled and clipped the gradients after every micro-batch.

Inside ``accelerator.accumulate(unet)`` the script called ``accelerator.clip_grad_norm_`` after each micro-batch's
backward. That call first unscales the optimizer's gradients through the GradScaler (under fp16) and then clips
``.grad`` as it stands: a partial sum of the accumulation window. Under fp16 the second micro-batch's ``unscale_``
raised, which is how it was noticed; in full precision nothing raised and every micro-batch clipped the partial
sum, so the step used neither the window's gradient nor its clipped version. Training on the global batch clips
its whole gradient once before the step. The fix clips only ``if accelerator.sync_gradients``: once per real
optimizer step, on the fully accumulated gradient. This reproduces the silent, full-precision run.
"""

import contextlib

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once

BUG = Bug("huggingface/diffusers", "pull", 686, "accumulation",
          "accelerator.clip_grad_norm_ (unscale + clip) after every micro-batch, not once when gradients sync",
          fix_acts="gradient")

GRADIENT_ACCUMULATION_STEPS = 4  # mlp's 12 samples a step: 4 equal micro-batches of 3
MAX_GRAD_NORM = 0.1  # below the global gradient's norm at every step of mlp: the reference clips too


class Accelerator:
    """The part of accelerate the script leans on, scaled down: ``accumulate`` decides whether this micro-batch
    ends the window (``sync_gradients``), ``backward`` divides by the accumulation steps, the prepared optimizer
    steps and zeroes only when gradients sync, ``clip_grad_norm_`` unscales (when a scaler is in use) then clips."""

    def __init__(self, gradient_accumulation_steps, mixed_precision="no"):
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.scaler = torch.amp.GradScaler("cpu") if mixed_precision == "fp16" else None
        self.sync_gradients, self._micro_step = True, 0

    @contextlib.contextmanager
    def accumulate(self, model):
        self._micro_step += 1
        self.sync_gradients = self._micro_step % self.gradient_accumulation_steps == 0
        yield

    def prepare(self, optimizer):
        return AcceleratedOptimizer(optimizer, self)

    def backward(self, loss):
        loss = loss / self.gradient_accumulation_steps
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip_grad_norm_(self, parameters, max_norm, optimizer):
        if self.scaler:
            self.scaler.unscale_(optimizer.optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


class AcceleratedOptimizer:
    def __init__(self, optimizer, accelerator):
        self.optimizer, self.accelerator = optimizer, accelerator

    def step(self):
        if self.accelerator.sync_gradients:
            if self.accelerator.scaler:
                self.accelerator.scaler.step(self.optimizer)
                self.accelerator.scaler.update()
            else:
                self.optimizer.step()

    def zero_grad(self):
        if self.accelerator.sync_gradients:
            self.optimizer.zero_grad()


def make_train_step(clip_when_syncing=True):
    accelerator = Accelerator(GRADIENT_ACCUMULATION_STEPS)  # the script's default: --mixed_precision no

    def train_step(model, optimizer, batch):
        optimizer = accelerator.prepare(optimizer)
        inputs, targets = batch
        for x, y in zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), targets.chunk(GRADIENT_ACCUMULATION_STEPS)):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients or not clip_when_syncing:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM, optimizer)
                optimizer.step()
                optimizer.zero_grad()

    return train_step


def make_train_step_as_reported():
    return make_train_step(clip_when_syncing=False)


clipped_full_batch = clipped_once(MAX_GRAD_NORM)


def buggy():
    return ec.check_step("mlp", make_train_step_as_reported, reference=clipped_full_batch, per_run=True)


def fixed():
    return ec.check_step("mlp", make_train_step, reference=clipped_full_batch, per_run=True)
