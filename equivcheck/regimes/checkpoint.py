"""Activation checkpointing inside accumulation: each micro-batch's forward under
``torch.utils.checkpoint`` (non-reentrant), its activations recomputed in backward instead of kept.

Recomputation replays the forward exactly, dropout masks included, because checkpoint saves the RNG
state before the forward and restores it for the replay (``preserve_rng_state=True``, the default).
Without that, the replay draws new masks: the gradients belong to another forward than the loss.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch.utils.checkpoint import checkpoint

from .base import Chunked, Pitfall
from .loop import accumulate


@dataclasses.dataclass(frozen=True)
class Checkpoint(Chunked):
    name = "checkpoint"
    summary = "accumulate K micro-batches, each forward under non-reentrant torch.utils.checkpoint: exact, less memory"
    preserve_rng_state: ClassVar[bool] = True

    def train_step(self, model, optimizer, batch, objective):
        def forward(inputs):
            return checkpoint(model, inputs, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)

        return accumulate(forward, optimizer, batch, objective, self.chunks)


@dataclasses.dataclass(frozen=True)
class CheckpointWithoutRngState(Checkpoint):
    name = "checkpoint_without_rng_state"
    summary = "PITFALL: checkpoint(preserve_rng_state=False) with dropout: the recomputed forward draws other masks"
    pitfall = Pitfall("dropout masks redrawn in a recomputed forward", twin="checkpoint")
    preserve_rng_state = False
