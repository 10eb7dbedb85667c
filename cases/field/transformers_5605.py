"""huggingface/transformers#5605: a resume with gradient accumulation skipped as many batches as optimizer steps.

The Trainer resumed from the checkpoint of an optimizer step: it read ``global_step`` (optimizer steps), worked out the
epochs already trained, ``global_step // (len(train_dataloader) // gradient_accumulation_steps)``, and the batches of
the current epoch to skip, ``global_step % (len(train_dataloader) // gradient_accumulation_steps)``, then skipped that
many batches of the epoch before training on. With accumulation each optimizer step had consumed
``gradient_accumulation_steps`` batches, so the skip counted optimizer steps where the loop skips batches: the report's
numbers, ``global_step`` 2748 with 4 accumulation steps, skipped 2748 batches instead of 10992, and the resumed run
trained again on batches it had already trained on. The fix (pull #8624, which also tests a resume with accumulation)
multiplies the skip by ``gradient_accumulation_steps``. Scaled down: 24 samples in micro-batches of 3, 2 micro-batches
per optimizer step (each micro-batch's mean loss divided by 2), 4 optimizer steps an epoch over 2 epochs; the loader
deals the samples in order (the Trainer's shuffle, reproducible on resume only from pull #11582 on, is left out).
The run is saved after 6 optimizer steps (2 into epoch 1) and resumed in a fresh process: as reported it skips 2 of
epoch 1's 8 micro-batches, not 4. The reference is the team's loop uninterrupted, in one process.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "issue", 5605, "resume",
          "resume with gradient accumulation skipped global_step batches, not global_step x accumulation steps",
          fixed_by="pull #8624", fix_acts="forward")

SAMPLES, MICRO_BATCH, ACCUMULATION, EPOCHS = 24, 3, 2, 2
BATCHES_PER_EPOCH = SAMPLES // MICRO_BATCH  # len(train_dataloader): micro-batches
UPDATES_PER_EPOCH = BATCHES_PER_EPOCH // ACCUMULATION  # optimizer steps an epoch
AT = UPDATES_PER_EPOCH + 2  # two optimizer steps into epoch 1


def data():
    """The training set, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(5605)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


ACCUMULATED = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_transformers_accumulated_resume", data=data,
    batch_size=MICRO_BATCH * ACCUMULATION, steps=UPDATES_PER_EPOCH, epochs=EPOCHS,
    description="mlp, 2 micro-batches of 3 per optimizer step over 2 epochs of 24 samples, resumed in epoch 1"))


class Trainer:
    """The Trainer's loop, one optimizer step per call of the team's step: on resume it skips the first batches of
    the epoch it resumes in, then accumulates ``ACCUMULATION`` micro-batches per optimizer step."""

    def __init__(self, global_step=0, skips_micro_batches=True):
        self.global_step = global_step
        epochs_trained = global_step // UPDATES_PER_EPOCH
        steps_trained_in_current_epoch = global_step % UPDATES_PER_EPOCH
        if skips_micro_batches:  # pull #8624: the skip counted in batches
            steps_trained_in_current_epoch *= ACCUMULATION
        self.micro_batches = self._batches(epochs_trained, steps_trained_in_current_epoch)

    @staticmethod
    def _batches(epochs_trained, steps_trained_in_current_epoch):
        inputs, targets = data()
        for _ in range(epochs_trained, EPOCHS):
            for step in range(BATCHES_PER_EPOCH):
                if steps_trained_in_current_epoch > 0:  # skip past any already trained steps
                    steps_trained_in_current_epoch -= 1
                    continue
                rows = slice(step * MICRO_BATCH, (step + 1) * MICRO_BATCH)
                yield inputs[rows], targets[rows]


TRAINERS = weakref.WeakKeyDictionary()  # the loop that owns each optimizer: a run's, started with it


def train_step(model, optimizer, batch):
    """One optimizer step of the loop on its own loader's micro-batches (the harness's batch is not used)."""
    if optimizer not in TRAINERS:  # this run's first step: its state is made once
        TRAINERS[optimizer] = Trainer()
    trainer = TRAINERS[optimizer]
    total = 0.0
    for _ in range(ACCUMULATION):
        inputs, targets = next(trainer.micro_batches)
        loss = F.cross_entropy(model(inputs), targets) / ACCUMULATION
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    trainer.global_step += 1
    return total


def save(model, optimizer, folder):
    """The checkpoint of an optimizer step: the model, the optimizer and trainer_state's global_step."""
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "global_step": TRAINERS[optimizer].global_step}, os.path.join(folder, "checkpoint.pt"))


def _load(model, optimizer, folder, skips_micro_batches):
    state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    TRAINERS[optimizer] = Trainer(state["global_step"], skips_micro_batches)


def load(model, optimizer, folder):
    """As fixed: the epoch's optimizer steps already trained, times the accumulation steps, batches skipped."""
    _load(model, optimizer, folder, skips_micro_batches=True)


def load_as_reported(model, optimizer, folder):
    """As reported: the epoch's optimizer steps already trained, skipped as if each were one batch."""
    _load(model, optimizer, folder, skips_micro_batches=False)


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(ACCUMULATED, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load_as_reported))


def fixed():
    return ec.check_step(ACCUMULATED, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=AT, save=save, load=load))
