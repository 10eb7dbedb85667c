"""Resuming from a checkpoint (equivcheck.regimes.resume): a run saved after its first global batch and restored by
processes started afresh must go on exactly as the uninterrupted run, on the same regime or another world size.

Measured on CPU in float64: a faithful resume matches full batch exactly in process (margin 0: the same kernels in a
fresh process), and to the accumulation's reordering on ranks, FSDP2 resharded 4 -> 2 and 2 -> 4 included. Each
pitfall leaves one part of the checkpoint out and is caught: Adam's moments restarted (a fresh optimizer), the first
global batch trained again (the position reset), under dropout the masks of step 0 drawn again (the random state of a
fresh process, not the saved one), within a warmup the schedule started again (the restored optimizer holds the
saved rate, so the step after the save is right and the one after it wrong), and under FSDP2 rank 0's shard of the optimizer's state restored on every rank
(half of every sharded weight's elements end wrong; under DDP, whose state every rank holds whole, it is harmless).
"""

import dataclasses

import torch

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from .dropout import dropout_one_layer
from .tokens import tokens

resume_tokens = ec.register_case(dataclasses.replace(
    tokens,
    name="resume_tokens",
    regimes=("full_batch", "resume:at=1", "accumulate:chunks=2>resume:at=1>ddp:world_size=2",
             "resume_without_optimizer:at=1", "resume_from_the_start:at=1"),
    expect_mismatch={"resume_without_optimizer": "a fresh optimizer after the restart: Adam's moments start again",
                     "resume_from_the_start": "the restored run trains the first global batch again",
                     "resume_optimizer_of_rank_zero": "every FSDP2 rank restores rank 0's shard of Adam's moments",
                     "resume_without_scaler": "the GradScaler counts its clean steps from zero again"},
    description="resume after the first global batch, in fresh processes: the checkpoint must hold the optimizer "
                "and the position",
))

resume_dropout = ec.register_case(dataclasses.replace(
    dropout_one_layer,
    name="resume_dropout",
    regimes=("full_batch", "resume_without_rng:at=1"),  # the matrix's share: the catalogue runs its twin, resume:at=1
    expect_mismatch={"resume_without_rng": "the fresh processes draw step 1's dropout masks from a fresh random "
                                           "state"},
    description="resume under dropout: the checkpoint must hold the random state",
    cpu_generator_only="",  # a resume restores the generator it drew from, CPU or CUDA
))



def warmup(optimizer):
    """A linear warmup over the first three steps, as a team's schedule starts."""
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=3)


resume_schedule = ec.register_case(dataclasses.replace(
    tokens,
    name="resume_schedule",
    scheduler=warmup,
    epochs=2,  # the restored optimizer's rate serves the step after the save: a lost schedule shows one step later
    regimes=("full_batch", "resume_without_scheduler:at=1"),  # the catalogue runs its twin, resume:at=1
    expect_mismatch={"resume_without_scheduler": "the warmup starts again after the restart: the third step's rate "
                                                 "is the second's"},
    description="resume within a warmup: the checkpoint must hold the scheduler",
))

# The catalogue's entries that use these cases.
add_entry(Entry("resume: optimizer state not saved in the checkpoint", "resume_tokens", "resume_without_optimizer:at=1"))
add_entry(Entry("resume: data position reset to the first batch", "resume_tokens", "resume_from_the_start:at=1"))
add_entry(Entry("resume: learning-rate scheduler not saved, within a warmup", "resume_schedule",
                "resume_without_scheduler:at=1"))
add_entry(Entry("resume: random state not restored, with dropout", "resume_dropout", "resume_without_rng:at=1"))
add_entry(Entry("resume: a sharded optimizer restored from rank 0's shard (FSDP2)", "resume_tokens",
                "fsdp:world_size=2>resume_optimizer_of_rank_zero:at=1"))
