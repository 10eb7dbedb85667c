"""KempnerInstitute/KempnerForge#51: checkpoints left the dataloader out, so every resume replayed the first batches.

KempnerForge's ``scripts/train.py`` handed its ``CheckpointManager.save()`` the model, the optimizer and the scheduler
but never the dataloader. Its ``StatefulDataLoader`` records how many batches it has yielded (``batches_yielded``) and
its ``DistributedSampler`` the epoch's shuffle position; none of it reached the checkpoint, so a resumed run started
the data from the first batch of the first epoch again: samples already trained were repeated and others skipped,
where an uninterrupted run goes on to the next batch. The fix (pull #52) passes ``dataloader=dataloader`` to both
save calls and restores in two phases: ``load()`` stashes the loader's state and the loop applies it
(``apply_dataloader_state``) to the loader it builds after the load. Scaled down: the training loop runs to a step
count, drawing 24 samples in batches of 6 shuffled per epoch (``seed + epoch``) over 2 epochs; it is saved after 2
batches and resumed in a fresh process. The reference is the team's loop uninterrupted, in one process.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("KempnerInstitute/KempnerForge", "issue", 51, "resume",
          "dataloader never passed to CheckpointManager.save(): every resume replayed the first epoch's batches",
          fixed_by="pull #52", fix_acts="forward")

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 24, 6, 2, 0
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE
AT = 2


def data():
    """The training set, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(51)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


TWO_EPOCHS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_kempnerforge_two_epochs", data=data, batch_size=BATCH_SIZE,
    steps=STEPS_PER_EPOCH, epochs=EPOCHS, description="mlp over 2 shuffled epochs of 24 samples, resumed in epoch 0"))


class StatefulDataLoader:
    """The loader, scaled down: its epoch's order drawn from ``seed + epoch``, its state the epoch and the batches
    yielded in it; an iterator made after ``load_state_dict`` goes on from there."""

    def __init__(self):
        self.dataset, self.epoch, self.batches_yielded = data(), 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded}

    def load_state_dict(self, state):
        self.epoch, self.batches_yielded = state["epoch"], state["batches_yielded"]

    def __iter__(self):
        while True:
            order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + self.epoch)).tolist()
            while self.batches_yielded < STEPS_PER_EPOCH:
                indices = order[self.batches_yielded * BATCH_SIZE:(self.batches_yielded + 1) * BATCH_SIZE]
                self.batches_yielded += 1
                yield tuple(part[indices] for part in self.dataset)
            self.epoch, self.batches_yielded = self.epoch + 1, 0


class Run:
    """train.py's loop, one step per call of the team's step, drawing from its own loader."""

    def __init__(self, step=0, dataloader_state=None):
        self.step, self.dataloader = step, StatefulDataLoader()
        if dataloader_state is not None:  # apply_dataloader_state: the stashed state, into the loader built after load
            self.dataloader.load_state_dict(dataloader_state)
        self.batches = iter(self.dataloader)


RUNS = weakref.WeakKeyDictionary()  # the run that owns each optimizer: started with it


def train_step(model, optimizer, batch):
    """One step of the loop on its loader's next batch (the harness's batch is not used)."""
    if optimizer not in RUNS:  # this run's first step: its state is made once
        RUNS[optimizer] = Run()
    run = RUNS[optimizer]
    inputs, targets = next(run.batches)
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.step += 1
    return loss.detach()


def _save(model, optimizer, folder, dataloader):
    run = RUNS[optimizer]
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": run.step}
    if dataloader:
        state["dataloader"] = run.dataloader.state_dict()
    torch.save(state, os.path.join(folder, "state.pt"))


def save(model, optimizer, folder):
    """As fixed: ``ckpt_mgr.save(..., dataloader=dataloader)``."""
    _save(model, optimizer, folder, dataloader=True)


def save_as_reported(model, optimizer, folder):
    """As reported: the model, the optimizer and the step; no dataloader."""
    _save(model, optimizer, folder, dataloader=False)


def load(model, optimizer, folder):
    """The model and the optimizer restored, the loader's state stashed and applied to the loop's new loader (where
    the checkpoint holds one)."""
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    RUNS[optimizer] = Run(state["step"], state.get("dataloader"))


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save_as_reported, load=load))


def fixed():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load))
