"""karpathy/build-nanogpt#30: ``require_backward_grad_sync`` was set after the forward, so the wrong micro-step synced.

The training loop set ``model.require_backward_grad_sync = (micro_step == grad_accum_steps - 1)`` between each
micro-step's forward and its ``loss.backward()``. DDP reads that flag in its forward, where it readies the
all-reduce for the coming backward, so each micro-step followed the value the previous one had left: the first
micro-step of every optimizer step all-reduced and the last did not. Each rank then stepped with the average of
its first micro-batch's gradients plus its own later ones, not the global batch's gradient that one process (or
``grad_accum_steps`` at 1) computes, and the ranks' weights drifted apart. The fix sets the flag before the forward.
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("karpathy/build-nanogpt", "pull", 30, "ddp",
          "require_backward_grad_sync set after the forward: the first micro-step all-reduced, not the last",
          fix_acts="communication")

GRAD_ACCUM_STEPS = 3  # each rank's 6 samples of mlp's 12: micro-batches of 2


def train_step(model, optimizer, batch, flag_before_forward=True):
    inputs, targets = batch
    for micro_step, (x, y) in enumerate(zip(inputs.chunk(GRAD_ACCUM_STEPS), targets.chunk(GRAD_ACCUM_STEPS))):
        if flag_before_forward:
            model.require_backward_grad_sync = micro_step == GRAD_ACCUM_STEPS - 1
        loss = F.cross_entropy(model(x), y) / GRAD_ACCUM_STEPS
        if not flag_before_forward:
            model.require_backward_grad_sync = micro_step == GRAD_ACCUM_STEPS - 1
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, flag_before_forward=False)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("mlp", train_step, world_size=2)
