"""huggingface/transformers#1563: the example scripts clipped the gradient after every micro-batch's backward.

The fine-tuning examples called ``clip_grad_norm_`` right after each micro-batch's ``loss.backward()`` and stepped
the optimizer every ``gradient_accumulation_steps`` micro-batches. Each clip rescaled the partial sum accumulated
so far, so the first micro-batches' gradients were shrunk again at every later clip and the step used
clip(...clip(clip(g1) + g2)... + gK) instead of clip(g1 + ... + gK): the later micro-batches weighed more, and the
result was neither the global batch's gradient nor its clipped version. Training on the global batch with
clipping clips the whole gradient once, just before the step. The fix clips once per accumulation window, in the
block that steps the optimizer, right before ``optimizer.step()``.
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once

BUG = Bug("huggingface/transformers", "issue", 1563, "accumulation",
          "clip_grad_norm_ after every micro-batch's backward: partial sums clipped, not the step's gradient",
          fixed_by="pull #1580", fix_acts="gradient")

GRADIENT_ACCUMULATION_STEPS = 4  # mlp's 12 samples a step: 4 equal micro-batches of 3
MAX_GRAD_NORM = 0.1  # below the global gradient's norm at every step of mlp: the clip engages in the reference too


def train_step(model, optimizer, batch, clip_every_backward=False):
    inputs, labels = batch
    for x, y in zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)):
        loss = F.cross_entropy(model(x), y) / GRADIENT_ACCUMULATION_STEPS
        loss.backward()
        if clip_every_backward:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    if not clip_every_backward:  # the window is complete: clip its whole gradient once, then step
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    model.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, clip_every_backward=True)


clipped_full_batch = clipped_once(MAX_GRAD_NORM)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, reference=clipped_full_batch)


def fixed():
    return ec.check_step("mlp", train_step, reference=clipped_full_batch)
