"""allenai/open-instruct#681: on resume, the batches already trained were skipped again in every later epoch.

open-instruct's ``finetune.py`` resumes from the checkpoint of a step: it restores the accelerator state, works out
``starting_epoch`` and ``resume_step`` (the batches of that epoch already trained), and in its epoch loop calls
``train_dataloader.set_epoch(epoch)`` and, when ``last_checkpoint_path and resume_step is not None``, iterates
``accelerator.skip_first_batches(train_dataloader, resume_step)`` instead of the loader itself. The condition did not
check the epoch, so every epoch after the resumed one skipped its first ``resume_step`` batches too: those samples
were never trained and the run made fewer updates than an uninterrupted one. The fix (the pull itself) skips them
only once, in the epoch the run resumes in. Scaled down: 24 samples in batches of 6, shuffled per epoch from
``seed + epoch`` (accelerate's seedable sampler), 2 epochs, saved after 2 batches of epoch 0 and resumed in a fresh
process; ``skip_first_batches`` keeps the loader's epoch, as accelerate does since its pull #4071 (a fault of its own,
row huggingface/accelerate#4071), and a step whose loop has ended trains nothing. The reference is the team's loop
uninterrupted, in one process.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("allenai/open-instruct", "pull", 681, "resume",
          "skip_first_batches(loader, resume_step) in every epoch after a resume, not only the resumed one",
          fix_acts="forward")

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 24, 6, 2, 42
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE
AT = 2  # the checkpoint of step 2: two batches into epoch 0


def data():
    """The SFT mixture, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(681)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


TWO_EPOCHS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_open_instruct_two_epochs", data=data, batch_size=BATCH_SIZE,
    steps=STEPS_PER_EPOCH, epochs=EPOCHS, description="mlp over 2 shuffled epochs of 24 samples, resumed in epoch 0"))


class Loader:
    """The prepared train dataloader, scaled down: ``set_epoch`` picks the epoch's order (``seed + epoch``); a loader
    made by ``skip_first_batches`` shares that order and leaves out its first batches."""

    def __init__(self, epoch=0, skip=0):
        self.dataset, self.epoch, self.skip = data(), epoch, skip

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + self.epoch)).tolist()
        for first in range(self.skip * BATCH_SIZE, SAMPLES, BATCH_SIZE):
            indices = order[first:first + BATCH_SIZE]
            yield tuple(part[indices] for part in self.dataset)


def skip_first_batches(loader, num_batches):
    return Loader(loader.epoch, num_batches)


class Finetune:
    """finetune.py's epoch loop, one batch per call of the step; it ends when its epochs are done."""

    def __init__(self, completed_steps=0, resumed=False, skips_once=True):
        self.completed_steps, self.skips_once = completed_steps, skips_once
        self.starting_epoch, self.resume_step = divmod(completed_steps, STEPS_PER_EPOCH)
        self.last_checkpoint_path = resumed
        self.train_dataloader = Loader()
        self.batches = self._epochs()

    def _epochs(self):
        for epoch in range(self.starting_epoch, EPOCHS):
            self.train_dataloader.set_epoch(epoch)
            skips = self.last_checkpoint_path and self.resume_step is not None
            if self.skips_once:
                skips = skips and epoch == self.starting_epoch
            if skips:
                active_dataloader = skip_first_batches(self.train_dataloader, self.resume_step)
            else:
                active_dataloader = self.train_dataloader
            yield from active_dataloader


RUNS = weakref.WeakKeyDictionary()  # the loop that owns each optimizer: a run's, started with it


def train_step(model, optimizer, batch):
    """One iteration of the loop over its own loader (the harness's batch is not used); once the loop has ended,
    nothing trains."""
    if optimizer not in RUNS:  # this run's first step: its state is made once
        RUNS[optimizer] = Finetune()
    run = RUNS[optimizer]
    mine = next(run.batches, None)
    if mine is None:
        return None
    inputs, targets = mine
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.completed_steps += 1
    return loss.detach()


def save(model, optimizer, folder):
    """accelerator.save_state in the folder named after the step (``step_N``)."""
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "step": RUNS[optimizer].completed_steps}, os.path.join(folder, "state.pt"))


def _load(model, optimizer, folder, skips_once):
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    RUNS[optimizer] = Finetune(state["step"], resumed=True, skips_once=skips_once)


def load(model, optimizer, folder):
    _load(model, optimizer, folder, skips_once=True)


def load_as_reported(model, optimizer, folder):
    _load(model, optimizer, folder, skips_once=False)


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load_as_reported))


def fixed():
    return ec.check_step(TWO_EPOCHS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load))
