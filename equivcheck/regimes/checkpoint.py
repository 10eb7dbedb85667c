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

RECOMPUTATION_CUTS_OFF = "parameters cut off from their gradient by a recomputed forward"


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
class CheckpointReentrant(Checkpoint):
    """The case's trunk under reentrant recomputation (``use_reentrant=True``, torch's old default), its head after
    it: a reentrant checkpoint back-propagates only where an input of its forward needs a gradient. Token ids never
    do, nor does a frozen base's output, so the parameters inside (adapters, an embedding) get none while the head
    trains on (Megatron-Bridge pull #5963's class); the loss still has a graph, and nothing fails."""

    name = "checkpoint_reentrant"
    summary = "PITFALL: the trunk under reentrant checkpoint, its inputs needing no gradient: nothing inside gets one"
    pitfall = Pitfall(RECOMPUTATION_CUTS_OFF, twin="checkpoint")
    needs_split = True

    def train_step(self, model, optimizer, batch, objective):
        trunk, head = objective.split(model)

        def forward(inputs):
            return head(checkpoint(trunk, inputs, use_reentrant=True, preserve_rng_state=self.preserve_rng_state))

        return accumulate(forward, optimizer, batch, objective, self.chunks)


@dataclasses.dataclass(frozen=True)
class CheckpointWithoutRngState(Checkpoint):
    name = "checkpoint_without_rng_state"
    summary = "PITFALL: checkpoint(preserve_rng_state=False) with dropout: the recomputed forward draws other masks"
    pitfall = Pitfall("dropout masks redrawn in a recomputed forward", twin="checkpoint")
    preserve_rng_state = False
