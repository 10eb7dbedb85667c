"""huggingface/accelerate#963: the prepared LR scheduler stepped on micro-batches where the optimizer did not.

Inside ``accelerator.accumulate(model)`` the training loop calls ``optimizer.step()`` and ``scheduler.step()`` on
every micro-batch and leaves it to accelerate to skip the ones that do not end the accumulation window. The
prepared optimizer skipped them, but the prepared scheduler advanced on every call: with K micro-batches per
update the schedule ran K times faster than the parameter updates, so optimizer step t used the learning rate of
step K*t. Training on the global batch advances the schedule once per optimizer step. The fix makes the prepared
scheduler return without stepping while gradients are not synchronised (the optimizer did not step).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/accelerate", "issue", 963, "accumulation",
          "prepared scheduler stepped on every micro-batch, the optimizer only when gradients synced",
          fixed_by="pull #999", fix_acts="state")

GRADIENT_ACCUMULATION_STEPS = 4  # mlp's global batches of 12: the loop's DataLoader yields micro-batches of 3


class GradientState:
    def __init__(self):
        self.sync_gradients = True


class Accelerator:
    """Scaled down: ``accumulate`` syncs on every K-th micro-batch and on the dataloader's last one."""

    def __init__(self, gradient_accumulation_steps, scheduler_skips_when_not_syncing=True):
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_state = GradientState()
        self.scheduler_skips_when_not_syncing = scheduler_skips_when_not_syncing
        self._micro_step = 0

    @contextlib.contextmanager
    def accumulate(self, model, end_of_dataloader):
        self._micro_step += 1
        self.gradient_state.sync_gradients = (self._micro_step % self.gradient_accumulation_steps == 0
                                              or end_of_dataloader)
        yield

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()

    def prepare(self, optimizer, scheduler):
        return (AcceleratedOptimizer(optimizer, self.gradient_state),
                AcceleratedScheduler(scheduler, self.gradient_state, self.scheduler_skips_when_not_syncing))


class AcceleratedOptimizer:
    def __init__(self, optimizer, gradient_state):
        self.optimizer, self.gradient_state = optimizer, gradient_state

    def step(self):
        if self.gradient_state.sync_gradients:
            self.optimizer.step()

    def zero_grad(self):
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad()


class AcceleratedScheduler:
    def __init__(self, scheduler, gradient_state, skips_when_not_syncing):
        self.scheduler, self.gradient_state = scheduler, gradient_state
        self.skips_when_not_syncing = skips_when_not_syncing

    def step(self):
        if self.skips_when_not_syncing and not self.gradient_state.sync_gradients:
            return  # the optimizer did not step: neither does the schedule
        self.scheduler.step()


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # halves after every update


def train_loop(model, optimizer, batches, scheduler_skips_when_not_syncing=True):
    accelerator = Accelerator(GRADIENT_ACCUMULATION_STEPS, scheduler_skips_when_not_syncing)
    optimizer, scheduler = accelerator.prepare(optimizer, make_scheduler(optimizer))
    loader = DataLoader(batches.dataset, batch_size=batches.batch_size // GRADIENT_ACCUMULATION_STEPS)
    losses, window_loss = [], 0.0
    for _ in range(batches.epochs):
        for index, (x, y) in enumerate(loader):
            with accelerator.accumulate(model, end_of_dataloader=index + 1 == len(loader)):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window_loss += loss.detach() / GRADIENT_ACCUMULATION_STEPS
            if accelerator.gradient_state.sync_gradients:  # the logged loss: the window's mean
                losses.append(window_loss)
                window_loss = 0.0
    return losses


def train_loop_as_reported(model, optimizer, batches):
    return train_loop(model, optimizer, batches, scheduler_skips_when_not_syncing=False)


def full_batch_loop(model, optimizer, batches):
    """The reference: one step on each global batch, the schedule advanced once after each step."""
    scheduler = make_scheduler(optimizer)
    losses = []
    for inputs, targets in batches:
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def buggy():
    return ec.check_loop("mlp", train_loop_as_reported, reference=full_batch_loop)


def fixed():
    return ec.check_loop("mlp", train_loop, reference=full_batch_loop)
