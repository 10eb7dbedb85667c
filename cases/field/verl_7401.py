"""verl-project/verl#7401: an SFT run resumed from a checkpoint saved at an epoch boundary trained no more batches.

verl's SFT trainer saves the ``StatefulDataLoader``'s state with every checkpoint. A checkpoint saved at the end of
an epoch holds a loader state marking that epoch's sampler exhausted. On resume the trainer already moves on to the
next epoch (``start_epoch = global_step // steps_per_epoch``) and calls ``set_epoch`` before iterating, and the
restored loader then fast-forwards the *new* epoch by the whole epoch's length (torchdata restores the position on
the first ``iter()`` after ``load_state_dict``), so that epoch yields 0 batches. The report: a resumed multi-epoch
job exits with status 0 having made none of the remaining updates, an under-trained model that looks complete. Pull
#5725 had fixed the same fault in the PPO trainer by not restoring the loader state when ``global_step %
steps_per_epoch == 0``; pull #7974 applies that check to the shared checkpoint handler the SFT trainer uses, and the
reporter's pull #7402 records the saved epoch position instead (both open when this row was written). The run as
fixed here is #7974's check. Scaled down: 24 samples in batches of 6 shuffled per epoch (seed + epoch, as
``DistributedSampler``), 2 epochs, saved after epoch 0's 4 batches and resumed in a fresh process; a step whose loop
has ended trains nothing. The reference is the team's loop uninterrupted, in one process.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("verl-project/verl", "issue", 7401, "resume",
          "epoch-boundary checkpoint: the exhausted loader state fast-forwarded the next epoch to 0 batches",
          fixed_by="pull #7974 (pull #5725's check)", fix_acts="forward")

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 24, 6, 2, 0
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE


def data():
    """The SFT set, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(7401)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


TWO_EPOCHS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_verl_two_epochs", data=data, batch_size=BATCH_SIZE, steps=STEPS_PER_EPOCH,
    epochs=EPOCHS, description="mlp over 2 shuffled epochs of 24 samples, resumed at the epoch boundary"))


class Sampler:
    """``DistributedSampler`` on one rank, scaled down: each epoch's order drawn from ``seed + epoch``."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + self.epoch)).tolist())


class StatefulDataLoader:
    """torchdata's ``StatefulDataLoader``, scaled down: its state is how many batches the current iteration has
    yielded; a loaded state is applied on the next ``iter()``, which skips that many batches of it."""

    def __init__(self, dataset, sampler):
        self.dataset, self.sampler = dataset, sampler
        self.yielded, self.pending = 0, None

    def __len__(self):
        return SAMPLES // BATCH_SIZE

    def state_dict(self):
        return {"num_yielded": self.yielded}

    def load_state_dict(self, state):
        self.pending = state

    def __iter__(self):
        order = list(self.sampler)
        batches = [order[i:i + BATCH_SIZE] for i in range(0, len(order), BATCH_SIZE)]
        skip, self.pending = (self.pending or {"num_yielded": 0})["num_yielded"], None
        self.yielded = skip
        for indices in batches[skip:]:
            self.yielded += 1
            yield tuple(part[indices] for part in self.dataset)


class Trainer:
    """The SFT trainer's fit loop, one global batch per call of the step; it ends when its epochs are done."""

    def __init__(self, global_step=0, loader_state=None):
        self.global_step = global_step
        self.sampler = Sampler()
        self.loader = StatefulDataLoader(data(), self.sampler)
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        self.batches = self._fit()

    def _fit(self):
        start_epoch = self.global_step // len(self.loader)
        for epoch in range(start_epoch, EPOCHS):
            self.sampler.set_epoch(epoch)
            yield from self.loader


TRAINERS = weakref.WeakKeyDictionary()  # the trainer that owns each optimizer: a run's, started with it


def train_step(model, optimizer, batch):
    """One iteration of the fit loop over the trainer's own loader (the harness's batch is not used); once the loop
    has ended, the job has exited and nothing trains."""
    if optimizer not in TRAINERS:  # this run's first step: its state is made once
        TRAINERS[optimizer] = Trainer()
    trainer = TRAINERS[optimizer]
    mine = next(trainer.batches, None)
    if mine is None:
        return None
    inputs, targets = mine
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    trainer.global_step += 1
    return loss.detach()


def save(model, optimizer, folder):
    """The checkpoint handler: model, optimizer, the global step and the dataloader's state."""
    trainer = TRAINERS[optimizer]
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "global_step": trainer.global_step, "dataloader": trainer.loader.state_dict()},
               os.path.join(folder, "state.pt"))


def _restored(model, optimizer, folder):
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state


def load_as_reported(model, optimizer, folder):
    """The loader's state restored whatever it holds."""
    state = _restored(model, optimizer, folder)
    TRAINERS[optimizer] = Trainer(state["global_step"], state["dataloader"])


def load(model, optimizer, folder):
    """As fixed: at an epoch boundary the saved loader state holds no position, so it is not restored."""
    state = _restored(model, optimizer, folder)
    at_boundary = state["global_step"] % STEPS_PER_EPOCH == 0
    TRAINERS[optimizer] = Trainer(state["global_step"], None if at_boundary else state["dataloader"])


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=STEPS_PER_EPOCH, save=save, load=load_as_reported))


def fixed():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=STEPS_PER_EPOCH, save=save, load=load))
