"""Packed sequences: the global batch's documents packed into rows (:mod:`equivcheck.packing`), checked against the
same documents padded one a row, and the ways packing goes wrong, each one difference from ``packed``.

``packed:length=L,chunks=K`` packs the documents into rows of ``L`` slots (0: the padded rows' length), each keeping
its positions, its document id and its targets, and accumulates over ``K`` micro-batches of rows, each its share of
the global batch's objective: the padded full batch's gradients exactly where the model attends within a slot's
document and embeds each slot's own position (a model whose attention drops the document mask, correct on padded
rows and wrong on packed ones, is a case's bug: ``packed_documents_causal_only`` in cases/packing.py). The packer's
own pitfalls, each a bug reported in 2025-2026:

- ``packed_positions_run_on``: positions counted over the row, not reset per document;
- ``packed_label_across``: each document's last token taught the next document's first (labels shifted over the
  packed row, not per document: pytorch/torchtitan#4075);
- ``packed_row_mean``: the loss normalised per packed row, its rows' means averaged (a row of one long document
  weighs as much as a row of many short ones).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..case import Batch, Objective
from ..errors import expect_int
from ..packing import DOCUMENTS, IGNORE, PADDING, POSITIONS, TOKENS, expect_layout, pack
from .base import Pitfall, Regime, finish_step
from .loop import PartLoss, backward_chunks, global_mean_part

# The classes of bug a packer makes, as suites/audit.py lists them.
POSITIONS_RUN_ON = "positions not reset per packed document"
LABEL_ACROSS = "a label across a packed document boundary"
ROW_MEAN = "loss normalised per packed row"


@dataclasses.dataclass(frozen=True)
class Packed(Regime):
    name = "packed"
    summary = "documents packed into rows, each keeping its positions, id and targets; the mean over the global tokens"
    fits_some_cases = True  # a case whose inputs are a documents layout (equivcheck.packing)
    anchorable = True
    relays_documents = True  # the localizer reads its records per document (judge/locate/documents.py)
    length: int = 0  # the slots of a packed row (0: the padded rows')
    chunks: int = 1  # micro-batches of packed rows, accumulated

    def __post_init__(self) -> None:
        expect_int("length", self.length, minimum=0)
        expect_int("chunks", self.chunks)

    def rows(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """What the model is fed and the loss is held to: the documents packed (a pitfall's one difference)."""
        expect_layout(batch.inputs, batch.targets)
        return pack(batch.inputs, batch.targets, self.length)

    def part(self, objective: Objective, batch: Batch, rows: int) -> PartLoss:
        """A micro-batch of packed rows' share of the loss: of the global batch's objective."""
        return global_mean_part(objective, batch)

    def train_step(self, model, optimizer, batch, objective):
        inputs, targets = self.rows(batch)
        loss = backward_chunks(objective.forward_of(model), inputs, targets, self.chunks,
                               self.part(objective, batch, len(targets)), objective=objective)
        finish_step(optimizer, objective)
        return loss


@dataclasses.dataclass(frozen=True)
class PackedPositionsRunOn(Packed):
    name = "packed_positions_run_on"
    summary = "PITFALL: packed with positions counted over the row, not reset per document"
    pitfall = Pitfall(POSITIONS_RUN_ON, twin="packed")

    def rows(self, batch):
        inputs, targets = super().rows(batch)
        slots = torch.arange(inputs.shape[2], device=inputs.device).expand_as(inputs[:, POSITIONS])
        inputs[:, POSITIONS] = torch.where(inputs[:, DOCUMENTS] == PADDING, 0, slots)
        return inputs, targets


@dataclasses.dataclass(frozen=True)
class PackedLabelAcross(Packed):
    name = "packed_label_across"
    summary = "PITFALL: labels shifted over the packed row: a document's last token learns the next one's first"
    pitfall = Pitfall(LABEL_ACROSS, twin="packed")

    def rows(self, batch):
        inputs, targets = super().rows(batch)
        ids = inputs[:, DOCUMENTS]
        last = (ids[:, :-1] != ids[:, 1:]) & (ids[:, :-1] != PADDING) & (ids[:, 1:] != PADDING)
        targets[:, :-1] = torch.where(last, inputs[:, TOKENS, 1:], targets[:, :-1])  # the next document's first
        return inputs, targets


@dataclasses.dataclass(frozen=True)
class PackedRowMean(Packed):
    name = "packed_row_mean"
    summary = "PITFALL: the loss normalised per packed row, the rows' means averaged"
    pitfall = Pitfall(ROW_MEAN, twin="packed")

    def part(self, objective, batch, rows):
        def row_means(output: Tensor, targets: Tensor) -> Tensor:
            means = [objective.mean(output[row:row + 1], targets[row:row + 1]) for row in range(len(targets))
                     if bool((targets[row] != IGNORE).any())]
            return torch.stack(means).sum() / rows

        return row_means
