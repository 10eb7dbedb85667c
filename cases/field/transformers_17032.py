"""huggingface/transformers#17032: resuming from a checkpoint saved at the end of an epoch never reloaded the RNG state.

The Trainer saved the random states with every checkpoint (``rng_state.pth``) and, on resume, reloaded them in its
batch-skipping loop: for each batch of the resumed epoch already trained it decremented
``steps_trained_in_current_epoch`` and, when the count reached 0, called ``_load_rng_state``. A checkpoint saved at an
epoch boundary (``save_strategy="epoch"``) leaves nothing to skip in the epoch the run resumes in, so the count was 0
from the start, the branch never ran, and the resumed run drew its dropout masks from the fresh process's seed instead
of the saved stream. The report's failing test, ``test_resume_training_with_randomness_from_epoch``, is the Trainer's
resume-with-randomness test with ``save_strategy="epoch"``; a mid-epoch checkpoint reloads the states when its skipping
ends (measured on this row's loop: equivalent). The fix (pull #17055) reloads them right before iterating the resumed
epoch when none of its batches is to be skipped (the Trainer's ``if epoch == epochs_trained and resume_from_checkpoint
is not None and steps_trained_in_current_epoch == 0``), as iterating the epoch itself draws from the global stream.
Scaled down: the case dropout_one_layer's model (one dropout layer, p=0.5) over 24 samples in batches of 6, 2 epochs,
saved after epoch 0's 4 batches (the torch random state with the model and the optimizer) and resumed in a fresh
process. The loop keeps its own count of the epoch's steps (what it skips and when it reloads the state) and trains on
the batch the harness hands it, the one the loop has reached (the data position is not this report's fault, and
equivcheck places dropout on a rank only for a forward on the batch it handed). The reference is the team's loop
uninterrupted, in one process.
"""

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "issue", 17032, "resume",
          "checkpoint at an epoch end: no batch to skip, so _load_rng_state never ran; dropout drew new masks",
          fixed_by="pull #17055", fix_acts="state")

SAMPLES, BATCH_SIZE, EPOCHS = 24, 6, 2
STEPS_PER_EPOCH = SAMPLES // BATCH_SIZE


def data():
    """The training set, the same in every process (its own generator)."""
    generator = torch.Generator().manual_seed(17032)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


EPOCH_CHECKPOINTS = ec.register_case(dataclasses.replace(
    ec.get_case("dropout_one_layer"), name="field_transformers_epoch_checkpoint", data=data, batch_size=BATCH_SIZE,
    steps=STEPS_PER_EPOCH, epochs=EPOCHS,
    description="dropout_one_layer's model over 2 epochs of 24 samples, resumed from the checkpoint at epoch 0's end"))


class Trainer:
    """The Trainer's loop, one optimizer step per call of the team's step: on resume it skips the batches of the
    resumed epoch already trained and reloads the saved random state when the skipping is done. It yields the epoch's
    steps it trains; the batch of each is the one the harness hands the step."""

    def __init__(self, global_step=0, rng_state=None, reloads_at_epoch_start=True):
        self.global_step = global_step
        self.steps = self._steps(global_step, rng_state, reloads_at_epoch_start)

    @staticmethod
    def _steps(global_step, rng_state, reloads_at_epoch_start):
        epochs_trained, steps_trained_in_current_epoch = divmod(global_step, STEPS_PER_EPOCH)
        for epoch in range(epochs_trained, EPOCHS):
            if (reloads_at_epoch_start and epoch == epochs_trained and rng_state is not None
                    and steps_trained_in_current_epoch == 0):  # pull #17055
                torch.set_rng_state(rng_state)
            for step in range(STEPS_PER_EPOCH):
                if steps_trained_in_current_epoch > 0:  # skip past any already trained steps
                    steps_trained_in_current_epoch -= 1
                    if steps_trained_in_current_epoch == 0:
                        torch.set_rng_state(rng_state)  # _load_rng_state(resume_from_checkpoint)
                    continue
                yield epoch, step


TRAINERS = weakref.WeakKeyDictionary()  # the loop that owns each optimizer: a run's, started with it


def train_step(model, optimizer, batch):
    """One step of the loop, on the batch it has reached."""
    if optimizer not in TRAINERS:  # this run's first step: its state is made once
        TRAINERS[optimizer] = Trainer()
    trainer = TRAINERS[optimizer]
    next(trainer.steps)
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    trainer.global_step += 1
    return loss.detach()


def save(model, optimizer, folder):
    """_save_checkpoint: the model, the optimizer, trainer_state's global_step and rng_state.pth."""
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "global_step": TRAINERS[optimizer].global_step, "cpu_rng": torch.get_rng_state()},
               os.path.join(folder, "checkpoint.pt"))


def _load(model, optimizer, folder, reloads_at_epoch_start):
    state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    TRAINERS[optimizer] = Trainer(state["global_step"], state["cpu_rng"], reloads_at_epoch_start)


def load(model, optimizer, folder):
    """As fixed: the random state reloaded before the resumed epoch when none of its batches are skipped."""
    _load(model, optimizer, folder, reloads_at_epoch_start=True)


def load_as_reported(model, optimizer, folder):
    """As reported: the random state reloaded only when the skipping of trained batches ends."""
    _load(model, optimizer, folder, reloads_at_epoch_start=False)


def uninterrupted(model, optimizer, batch):
    """The reference: the team's loop in one process, never stopped."""
    return train_step(model, optimizer, batch)


def buggy():
    return ec.check_step(EPOCH_CHECKPOINTS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=STEPS_PER_EPOCH, save=save, load=load_as_reported))


def fixed():
    return ec.check_step(EPOCH_CHECKPOINTS, train_step, uninterrupted, world_size=1,
                         resume=ec.Checkpoint(at=STEPS_PER_EPOCH, save=save, load=load))
