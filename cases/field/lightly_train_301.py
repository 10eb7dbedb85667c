"""lightly-ai/lightly-train#301: an interrupted run resumed with its learning-rate schedule back at the warm-up.

The pull reports that training DINOv3 EoMT, or any task with the ``TwoStageWarmupPolySchedule``, with
``resume_interrupted=True`` put the learning rate back to the schedule's initial stage: the checkpoint's training
state (``TrainTaskState``, the dict Fabric saves and loads into in place: the model, the optimizer, the train
dataloader and the step) did not hold the learning-rate scheduler, so the scheduler built for the resumed run started
again from ``last_epoch = -1``. The optimizer's own state was restored, so the first resumed step used the saved
learning rate, and every ``scheduler.step()`` after it followed the schedule from its start. The fix (the pull itself)
adds ``scheduler: LRScheduler`` to ``TrainTaskState``, so the scheduler's state is saved with the checkpoint and
loaded into the scheduler the resumed run builds (tested by rerunning and resuming the same training: the learning
rate consistent). Scaled down: mlp in 6 batches of 6 samples, SGD with momentum under a two-stage schedule (a linear
warm-up over 2 steps from a tenth of the learning rate, then polynomial decay, stepped after every optimizer step),
saved after 3 steps and resumed in a fresh process that builds the optimizer and the scheduler anew and loads the
checkpoint into them. The reference is the team's step with its schedule, uninterrupted, in one process.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("lightly-ai/lightly-train", "pull", 301, "resume",
          "LR scheduler left out of TrainTaskState: on resume last_epoch was -1 and the warm-up started again",
          fix_acts="state")

STEPS, WARMUP_STEPS, WARMUP_START, POWER = 6, 2, 0.1, 0.9
AT = 3

SCHEDULED = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_lightly_train_scheduled", batch_size=6, steps=STEPS,
    description="mlp in 6 batches of 6 under a warm-up then polynomial learning-rate schedule, resumed after 3 steps"))


def two_stage_warmup_poly(step):
    """The schedule's factor of the base learning rate: a linear warm-up, then polynomial decay to 0."""
    if step < WARMUP_STEPS:
        return WARMUP_START + (1 - WARMUP_START) * step / WARMUP_STEPS
    return (1 - (step - WARMUP_STEPS) / (STEPS - WARMUP_STEPS)) ** POWER


class Training:
    """A run's scheduler, built on its optimizer as the train task builds it."""

    def __init__(self, optimizer):
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, two_stage_warmup_poly)


RUNS = weakref.WeakKeyDictionary()  # the training state of each optimizer: a run's, started with it


def train_step(model, optimizer, batch):
    if optimizer not in RUNS:  # (building a scheduler steps it: only once a run)
        RUNS[optimizer] = Training(optimizer)
    run = RUNS[optimizer]
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.scheduler.step()
    return loss.detach()


def _save(model, optimizer, folder, with_scheduler):
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    if with_scheduler:  # the pull: scheduler in TrainTaskState
        state["scheduler"] = RUNS[optimizer].scheduler.state_dict()
    torch.save(state, os.path.join(folder, "checkpoint.pt"))


def save(model, optimizer, folder):
    """As fixed: the training state holds the scheduler too."""
    _save(model, optimizer, folder, with_scheduler=True)


def save_as_reported(model, optimizer, folder):
    """As reported: the model and the optimizer only."""
    _save(model, optimizer, folder, with_scheduler=False)


def load(model, optimizer, folder):
    """The resumed run builds its optimizer and scheduler, then loads the checkpoint into what it holds: the scheduler
    too where the checkpoint has it."""
    run = RUNS[optimizer] = Training(optimizer)
    state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in state:
        run.scheduler.load_state_dict(state["scheduler"])


def uninterrupted(model, optimizer, batch):
    """The reference: the team's step with its schedule, in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(SCHEDULED, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save_as_reported, load=load))


def fixed():
    return ec.check_step(SCHEDULED, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load))
