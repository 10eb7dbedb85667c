"""KempnerInstitute/KempnerForge#57: the StatefulDataLoader lost its place on the second resume within an epoch.

KempnerForge's ``StatefulDataLoader`` reset ``_batches_yielded`` to 0 on every ``__iter__``, its ``load_state_dict``
read ``batches_yielded`` into a local variable and never wrote it back, and the sampler's ``set_skip`` was used up by
the first ``iter()``. The report's sequence: run 1 yields 30 batches and saves ``batches_yielded=30``; run 2 skips 30
batches, restarts its counter at 0, yields 10 more and saves ``batches_yielded=10``, not 40; run 3 skips only 10, so
every resume after the first within an epoch shifted the data order silently. The fix (pull #58) stores the loaded
count on the loader, re-applies the skip on every ``iter()`` and keeps the counter monotonic within the epoch. Scaled
down: 24 samples in batches of 6 shuffled per epoch, saved after 2 and after 4 global batches (one epoch), each
segment in fresh processes (``Checkpoint(at=(2, 4))``); as reported the third segment trains batches 2 and 3 of the
epoch again where the uninterrupted loop trains 4 and 5 (the second epoch's first two).
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("KempnerInstitute/KempnerForge", "issue", 57, "resume",
          "StatefulDataLoader's batch count restarted at 0 after a resume: the second resume skipped too few",
          fixed_by="pull #58", fix_acts="forward")

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 24, 6, 2, 0
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE
SAVES = (2, 4)


def data():
    """The training set, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(57)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


TWO_EPOCHS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_kempnerforge_57_two_epochs", data=data, batch_size=BATCH_SIZE,
    steps=STEPS_PER_EPOCH, epochs=EPOCHS, description="mlp over 2 shuffled epochs of 24 samples, resumed twice"))


class StatefulDataLoader:
    """The loader, scaled down: its epoch's order drawn from ``seed + epoch``; ``batches_yielded`` its position in the
    epoch, saved by ``state_dict``. As reported, a loaded count only sets the skip of the next ``iter()``, and the
    counter starts again at 0 there; as fixed, the count goes on from the loaded one."""

    def __init__(self, monotonic: bool):
        self.dataset, self.epoch, self.batches_yielded, self.skip = data(), 0, 0, 0
        self.monotonic = monotonic

    def state_dict(self):
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded}

    def load_state_dict(self, state):
        self.epoch, self.skip = state["epoch"], state["batches_yielded"]
        if self.monotonic:  # the fix: the loaded count is the loader's own
            self.batches_yielded = state["batches_yielded"]

    def __iter__(self):
        start, self.skip = self.skip, 0
        if not self.monotonic:  # as reported: every iter() starts its count again
            self.batches_yielded = 0
        while True:
            order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + self.epoch)).tolist()
            for index in range(start, STEPS_PER_EPOCH):
                self.batches_yielded += 1
                yield tuple(part[order[index * BATCH_SIZE:(index + 1) * BATCH_SIZE]] for part in self.dataset)
            self.epoch, self.batches_yielded, start = self.epoch + 1, 0, 0


class Run:
    """train.py's loop, one step per call of the team's step, drawing from its own loader."""

    def __init__(self, monotonic: bool, dataloader_state=None):
        self.dataloader = StatefulDataLoader(monotonic)
        if dataloader_state is not None:
            self.dataloader.load_state_dict(dataloader_state)
        self.batches = iter(self.dataloader)


RUNS = weakref.WeakKeyDictionary()  # the run that owns each optimizer: started with it


def _step(model, optimizer, monotonic):
    if optimizer not in RUNS:  # this run's first step: its state is made once
        RUNS[optimizer] = Run(monotonic)
    inputs, targets = next(RUNS[optimizer].batches)
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    """One step on the loader's next batch (the harness's batch is not used), the loader as fixed."""
    return _step(model, optimizer, monotonic=True)


def train_step_as_reported(model, optimizer, batch):
    return _step(model, optimizer, monotonic=False)


def save(model, optimizer, folder):
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "dataloader": RUNS[optimizer].dataloader.state_dict()}, os.path.join(folder, "state.pt"))


def _load(model, optimizer, folder, monotonic):
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    RUNS[optimizer] = Run(monotonic, state["dataloader"])


def load(model, optimizer, folder):
    _load(model, optimizer, folder, monotonic=True)


def load_as_reported(model, optimizer, folder):
    _load(model, optimizer, folder, monotonic=False)


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(TWO_EPOCHS, train_step_as_reported, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=SAVES, save=save, load=load_as_reported))


def fixed():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=SAVES, save=save, load=load))
