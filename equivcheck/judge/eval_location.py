"""Where a distributed evaluation parts from one process: in the model's outputs, or after them, in the metric.

An evaluation has two places a metric can part. The model computes one output per sample (``forward``): a sample a
rank's model computed otherwise, or one no rank evaluated, parts there. Everything after the outputs is the team's
code that makes them a metric (``metric``): gathering the ranks' outputs, dropping the samples a sampler repeated to
even out the ranks, reducing sums and counts. Where every sample one process evaluates was evaluated on the ranks and
every output matches, the metric parts after the model, whatever the repeats: a faithful evaluation pads as a
flawed one does and drops the repeats in its gathering.

Both sides' records come from :class:`equivcheck.runners.evaluate.SamplesSeen`; a side whose calls do not read back
to the dataset's samples leaves the evaluation unlocated, with why.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..arrays import from_array
from ..diff import Location, TensorDiff
from ..precision import Tolerance
from .hints import few


def locate_eval(single: dict, replies: Sequence[dict], tolerance: Tolerance,
                margin: float) -> tuple[Location | None, str]:
    """Where the ranks' evaluation (``replies``, each rank's) parts from ``single``'s, with the metric's ``margin``;
    or no location and why."""
    sides = [("one process", single["seen"])] + [(f"rank {rank}", reply["seen"]) for rank, reply in enumerate(replies)]
    for side, seen in sides:
        if "unread" in seen:
            return None, f"not said: on {side}, {seen['unread']}"
    expected = single["seen"]
    ranks = [reply["seen"] for reply in replies]
    whole = all("outputs" in seen for seen in (expected, *ranks))
    outputs = [_outputs(seen, whole) for seen in (expected, *ranks)]
    for index, computed in enumerate(outputs[0]):
        for rank, theirs in enumerate(outputs[1:]):
            if computed is None or theirs[index] is None:
                continue
            apart = _apart(theirs[index], computed, tolerance)
            if apart > 1:
                return Location(None, "forward", "", f"the model's output for sample {index} on rank {rank}",
                                None if apart == math.inf else apart,
                                "fed the same sample, the model computed otherwise than in one process"
                                + ("" if whole else " (their digests part: three sums of each output)")), ""
    counts = [sum(seen["counts"][index] for seen in ranks) for index in range(len(expected["counts"]))]
    missed = [index for index, count in enumerate(expected["counts"]) if count and not counts[index]]
    if missed:
        return Location(None, "forward", "", "the samples the model was fed", None,
                        f"{len(missed)} of the samples one process evaluates no rank evaluated ({_few(missed)}): the "
                        "sampler or the loop dropped them"), ""
    repeated = [index for index, count in enumerate(counts) if count > expected["counts"][index]]
    repeats = "" if not repeated else (f"; {len(repeated)} evaluated more often than in one process ({_few(repeated)}"
                                       ": a sampler's padding, which the metric must leave out)")
    outputs = "every output matches" if whole else "every output's digest (three sums of it) matches"
    return Location(None, "metric", "", "the metric computed from the model's outputs", margin,
                    f"every sample one process evaluates was evaluated on the ranks, and {outputs}"
                    f"{repeats}: the team's code that gathers and reduces them parts"), ""


def _few(indices: list[int]) -> str:
    return few([f"sample {index}" for index in indices])


def _outputs(seen: dict, whole: bool) -> list:
    """A side's output rows, whole (tensors) where every side kept them so, else as digests."""
    if "digests" in seen:
        return seen["digests"]
    rows = [None if out is None else from_array(out) for out in seen["outputs"]]
    return rows if whole else [None if row is None else digests(row[None])[0] for row in rows]


def _apart(actual: Tensor | tuple, expected: Tensor | tuple, tolerance: Tolerance) -> float:
    """How far two output rows (or their digests) are apart, in units of what ``tolerance`` allows; inf where their
    shapes (sizes) differ. Digests are allowed what rows within the tolerance elementwise allow their sums."""
    if isinstance(expected, Tensor):
        return TensorDiff.of(actual, expected, tolerance).margin if actual.shape == expected.shape else math.inf
    *sums, magnitude, size = expected
    if actual[3] != size:
        return math.inf
    allowed = tolerance.atol * size + tolerance.rtol * magnitude
    apart = max(abs(a - e) for a, e in zip(actual[:2], sums))
    return apart / allowed if allowed else (math.inf if apart else 0.0)


# The period of a digest's weights: a prime, so that no layout of a row (its last dimension's size) lines up with it.
PERIOD = 1021


def digests(rows: Tensor) -> list[tuple[float, float, float, int]]:
    """Output rows (one per sample, flattened) as three float64 sums each: plain, weighted by fixed pseudo-random
    weights in [-1, 1] (the same on every side, repeating every :data:`PERIOD` elements), and of magnitudes; and their
    size. Rows within a tolerance elementwise are within ``atol * size + rtol * magnitudes`` in both weighted sums: a
    digest never parts where its rows agree, and may miss a difference that small next to the whole row."""
    rows = rows.double().reshape(len(rows), -1)
    size = rows.shape[1]
    padded = F.pad(rows, (0, -size % PERIOD)).reshape(len(rows), -1, PERIOD)
    weighted = (padded @ _weights().to(rows.device)).sum(1)
    sums = torch.stack([rows.sum(1), weighted, rows.abs().sum(1)], dim=1)
    return [(*map(float, row), size) for row in sums.cpu().tolist()]


@functools.cache
def _weights() -> Tensor:
    return torch.rand(PERIOD, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2 - 1
