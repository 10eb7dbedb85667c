"""In-process regimes: full batch (the reference) and the faithful ways of accumulating gradients.

Each reproduces ``full_batch`` up to rounding, and most exist to save activation memory: sample by
sample, micro-batches, a retained graph cut per loss part, the head of a model accumulated over
its detached trunk output (seed 000), and seed 002's summed loss, which saves nothing.
"""

from __future__ import annotations

import dataclasses
import math

from .base import Chunked, Regime, chunk_pairs, expect_max_norm, finish_step
from .loop import accumulate, backward_chunks, global_mean_part, inputs_only


@dataclasses.dataclass(frozen=True)
class FullBatch(Regime):
    """``max_norm=M``: the reference of a team that clips (``clip_grad_norm_(..., M)`` before each step)."""

    max_norm: float = math.inf
    name = "full_batch"
    summary = "one forward and one backward on the global batch (the reference); max_norm=M clips before the step"
    releases_gradients = True
    anchorable = True

    def __post_init__(self) -> None:
        expect_max_norm(self.max_norm)

    def clips_at(self) -> float | None:
        return self.max_norm if self.max_norm < math.inf else None

    def train_step(self, model, optimizer, batch, objective):
        loss = objective.share(objective.forward(model, batch.inputs, batch.targets), batch.targets, batch)
        objective.backward(loss)
        finish_step(optimizer, objective, self.max_norm)
        return loss.detach()


@dataclasses.dataclass(frozen=True)
class SampleBySample(Regime):
    name = "sample_by_sample"
    anchorable = True
    summary = "one forward and backward per sample, each weighted by 1/items of the global batch"

    def train_step(self, model, optimizer, batch, objective):
        return accumulate(model, optimizer, batch, objective, len(batch))

    def micro_batches(self, case):
        return case.batch_size


@dataclasses.dataclass(frozen=True)
class Accumulate(Chunked):
    max_norm: float = math.inf
    name = "accumulate"
    summary = "K micro-batches, each loss sum / global item count, one optimizer step; max_norm=M clips the sum"

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_max_norm(self.max_norm)

    def clips_at(self) -> float | None:
        return self.max_norm if self.max_norm < math.inf else None

    def train_step(self, model, optimizer, batch, objective):
        return accumulate(model, optimizer, batch, objective, self.chunks, max_norm=self.max_norm)


@dataclasses.dataclass(frozen=True)
class RetainedGraph(Chunked):
    name = "retained_graph"
    summary = "forward once, backward(retain_graph=True) per loss part: same gradients, no memory saved"

    def train_step(self, model, optimizer, batch, objective):
        output = objective.forward(model, batch.inputs, batch.targets)
        total = backward_chunks(lambda out, targets: out, output, batch.targets, self.chunks,
                                global_mean_part(objective, batch), retain_graph=True,
                                objective=objective)
        finish_step(optimizer, objective)
        return total


@dataclasses.dataclass(frozen=True)
class DetachedPartial(Chunked):
    name = "detached_partial"
    summary = "trunk forward once, head accumulated per chunk on its detached output, trunk backward once"
    needs_split = True
    anchorable = False  # it runs the trunk and the head apart: no forward of the whole model begins its steps

    def train_step(self, model, optimizer, batch, objective):
        trunk, head = self.parts(model, objective)
        total = backward_detached(trunk, head, batch.inputs, batch.targets, self.chunks,
                                  global_mean_part(objective, batch), objective)
        finish_step(optimizer, objective)
        return total

    def parts(self, model, objective):
        """The trunk and the head this step drives: the case's split of the model (a wrapper's own, in parts)."""
        return objective.split(model)


def backward_detached(trunk, head, inputs, targets, chunks, part_loss, objective, around=None):
    """Seed 000's accum_forward: the trunk forward once, the head back-propagated per chunk of the trunk's
    detached output (``around(last)``: each chunk's context), then the trunk back-propagated once with the
    activation gradient the chunks accumulated. Returns the chunks' summed loss."""
    features = trunk(inputs)
    detached = features.detach().requires_grad_()
    total = backward_chunks(inputs_only(head), detached, targets, chunks, part_loss, objective=objective, around=around)
    backward_trunk(features, detached)
    return total


def backward_trunk(features, detached) -> None:
    """The trunk's one backward, with the activation gradient the head's chunks accumulated on ``detached``."""
    if features.requires_grad:  # a trunk with nothing to train (identity, frozen) has no graph to back-propagate
        features.backward(detached.grad)  # already scaled: the head's backward went through the scaler


@dataclasses.dataclass(frozen=True)
class SummedLoss(Chunked):
    """Seed 002's ``loss += item_loss``: it looks like accumulation (a forward per micro-batch, each loss
    scaled by the global item count) but sums the losses and calls backward once, after the last
    forward. Exact gradients, full-batch memory: every graph waits for that one backward, and the
    harness must say both (equivalent, and "accumulates gradients but saves no memory")."""

    name = "summed_loss"
    summary = "seed 002's `loss += item_loss` over K micro-batches, one backward: exact, saves no memory"

    def train_step(self, model, optimizer, batch, objective):
        part_loss = global_mean_part(objective, batch)
        loss = 0.0
        for x, y in chunk_pairs(batch, self.chunks):
            loss += part_loss(objective.forward(model, x, y), y)  # every micro-batch's graph lives until backward
        objective.backward(loss)  # through the precision mode's loss scaler, like every regime
        finish_step(optimizer, objective)
        return loss.detach()

