"""huggingface/accelerate#4071: a mid-epoch resume through skip_first_batches reset the sampler to epoch 0.

The pull reports that resuming from a checkpoint saved in the middle of an epoch did not reproduce the loss of the
uninterrupted run (at an epoch boundary it did). The training loop sets the epoch on the prepared dataloader,
``epoch_dataloader.set_epoch(1)``, and, for the epoch it resumes in, skips the batches already trained with
``skip_first_batches``. That builds a new ``DataLoaderShard`` over the same sampler whose ``iteration`` attribute
starts at 0, and ``DataLoaderShard.__iter__`` begins with ``self.set_epoch(self.iteration)``: ``set_epoch(0)``
reset the shared sampler from epoch 1 to epoch 0, so the resumed epoch drew epoch 0's shuffle and, after skipping
the first batches of that order, trained on other samples than the uninterrupted run. The fix (the pull itself)
carries the original dataloader's ``iteration`` into the one ``skip_first_batches`` makes. Here, scaled down, a
seedable random sampler (seeded with ``seed + epoch``, as accelerate's) deals 24 samples in batches of 6, 2
epochs; the run is saved after 6 global batches (2 into epoch 1) and resumed in a fresh process. The reference is
the team's own loop uninterrupted: one process over the same loader, every epoch shuffled by its own seed.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/accelerate", "pull", 4071,  "resume",
          "skip_first_batches made a DataLoaderShard with iteration 0: resumed epoch set the sampler to epoch 0",
          fix_acts="forward")

SAMPLES, BATCH_SIZE, EPOCHS, SEED = 24, 6, 2, 42
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE


def data():
    """The dataset, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(4071)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


SHUFFLED = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_accelerate_shuffled_epochs", data=data, batch_size=BATCH_SIZE,
    steps=STEPS_PER_EPOCH, epochs=EPOCHS,
    description="mlp over 2 epochs of 24 samples the team's own sampler shuffles by epoch, resumed mid-epoch 1"))


class SeedableRandomSampler:
    """accelerate's sampler, scaled down: each epoch's order is drawn from ``initial_seed + epoch``."""

    def __init__(self, length, initial_seed=SEED):
        self.length, self.initial_seed, self.epoch = length, initial_seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.initial_seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())


class BatchSampler:
    def __init__(self, sampler, batch_size):
        self.sampler, self.batch_size = sampler, batch_size

    def __iter__(self):
        order = list(self.sampler)
        return iter([order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)])


class DataLoaderShard:
    """accelerate's ``DataLoaderShard``, scaled down: ``__iter__`` first sets the epoch to its own ``iteration``."""

    def __init__(self, dataset, batch_sampler, skip_batches=0, iteration=0):
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.skip_batches, self.iteration = skip_batches, iteration

    def __iter__(self):
        self.set_epoch(self.iteration)
        for index, indices in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield tuple(part[indices] for part in self.dataset)
        self.iteration += 1

    def set_epoch(self, epoch):
        if self.iteration != epoch:
            self.iteration = epoch
        self.batch_sampler.sampler.set_epoch(epoch)


def skip_first_batches(dataloader, num_batches, keeps_iteration=True):
    """A loader over the same batch sampler that skips the first ``num_batches``; as fixed (pull #4071), it carries
    the original's ``iteration``; as reported, it started at 0."""
    return DataLoaderShard(dataloader.dataset, dataloader.batch_sampler, skip_batches=num_batches,
                           iteration=dataloader.iteration if keeps_iteration else 0)


class Trainer:
    """The team's loop, one global batch per call of the step: every epoch ``set_epoch(epoch)``; in the epoch it
    resumes in, the batches already trained skipped with ``skip_first_batches``."""

    def __init__(self, keeps_iteration, global_step=0):
        self.keeps_iteration, self.global_step = keeps_iteration, global_step
        self.loader = DataLoaderShard(data(), BatchSampler(SeedableRandomSampler(SAMPLES), BATCH_SIZE))
        self.batches = self._batches()

    def _batches(self):
        start_epoch, trained_in_epoch = divmod(self.global_step, STEPS_PER_EPOCH)
        for epoch in range(start_epoch, EPOCHS):
            self.loader.set_epoch(epoch)
            epoch_loader = self.loader
            if epoch == start_epoch and trained_in_epoch:
                epoch_loader = skip_first_batches(self.loader, trained_in_epoch, self.keeps_iteration)
            yield from epoch_loader


TRAINERS = weakref.WeakKeyDictionary()  # the loop that owns each optimizer: a run's, started with it


def trainer_of(optimizer, keeps_iteration=True):
    if optimizer not in TRAINERS:
        TRAINERS[optimizer] = Trainer(keeps_iteration)
    return TRAINERS[optimizer]


def train_step(model, optimizer, batch, keeps_iteration=True):
    """One iteration of the team's loop: the batch is the one its own loader deals (the harness's is not used)."""
    trainer = trainer_of(optimizer, keeps_iteration)
    inputs, targets = next(trainer.batches)
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    trainer.global_step += 1
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, keeps_iteration=False)


def save(model, optimizer, folder):
    """The model, the optimizer and the loop's position (accelerate's save_state and the trainer's step)."""
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "global_step": TRAINERS[optimizer].global_step}, os.path.join(folder, "state.pt"))


def _load(model, optimizer, folder, keeps_iteration):
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    TRAINERS[optimizer] = Trainer(keeps_iteration, global_step=state["global_step"])


def load(model, optimizer, folder):
    _load(model, optimizer, folder, keeps_iteration=True)


def load_as_reported(model, optimizer, folder):
    _load(model, optimizer, folder, keeps_iteration=False)


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


AT = STEPS_PER_EPOCH + 2  # two batches into epoch 1


def buggy():
    return ec.check_step(SHUFFLED, train_step_as_reported, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load_as_reported))


def fixed():
    return ec.check_step(SHUFFLED, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load))
