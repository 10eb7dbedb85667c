"""The comparator: every parameter's gradient at every step, the final weights, buffers and losses, judged against
the reference (the figures and their types: :mod:`equivcheck.diff`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..diff import CHUNK, Comparison, Measurement, TensorDiff
from ..errors import InvalidArgument
from ..precision import PRECISIONS, Tolerance
from ..result import RunResult


def tolerance_of(reference: RunResult, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """What a comparison with ``reference`` is judged at by default: its precision mode's tolerance (its weights'
    dtype where it names none), unless the call gives ``rtol`` and ``atol``."""
    mode = PRECISIONS.get(reference.precision) or next(iter(reference.weights.values())).dtype.to_real()
    return Tolerance.resolve(mode, rtol, atol)


def compare(
    reference: RunResult, candidate: RunResult, *, rtol: float | None = None, atol: float | None = None,
    tolerance: Tolerance | None = None,
) -> Comparison:
    """Compare ``candidate`` against ``reference`` everywhere; the tolerance follows the precision mode,
    unless ``rtol`` and ``atol`` or a whole ``tolerance`` (a lossy regime's own bound) are given. A candidate
    compared as it trained (``train(against=...)``) brings its measurement, taken at that tolerance."""
    if tolerance is not None:
        if not isinstance(tolerance, Tolerance):
            raise InvalidArgument.type("tolerance", tolerance, "an equivcheck.Tolerance")
        tol = tolerance
    else:
        tol = tolerance_of(reference, rtol, atol)
    measured = candidate.measured
    if measured is None:
        within = _small_and_within(reference, candidate, tol)
        if within is not None:
            return Comparison(tol, (), (), *within)
        measured = Measurement(tol)
        for step, (ref_grads, cand_grads) in enumerate(zip(reference.grads, candidate.grads)):
            measured.add("grad", step, cand_grads, ref_grads)
        measured.add_final("weight", candidate.weights, reference.weights)
        measured.add_final("buffer", candidate.buffers, reference.buffers)
    elif measured.tolerance != tol:
        raise InvalidArgument(f"tolerance={tol} is not allowed here: the candidate was compared as it trained, at "
                              f"{measured.tolerance}; compare it at that tolerance, or train it without against=")
    return measured.conclude(reference, candidate)


# Runs with at most this many elements in all (every step's gradients, weights, buffers, losses) are scanned first as
# one tensor per dtype: a small case's check is a few dozen tensors, each a few torch calls' worth of overhead.
SMALL_RUN = CHUNK


def _small_and_within(reference: RunResult, candidate: RunResult, tol: Tolerance) -> tuple[float, float, float] | None:
    """``(max_abs, max_rel, margin)`` of two small runs of the same structure whose every element is within ``tol``,
    from one scan of their elements joined; None otherwise (the per-quantity path then finds and locates each
    mismatch)."""
    if reference.optimizer_steps != candidate.optimizer_steps or reference.weights.keys() != candidate.weights.keys() \
            or reference.buffers.keys() != candidate.buffers.keys():
        return None
    pairs = [(cand.get(name), expected) for ref, cand in zip(reference.grads, candidate.grads)
             for name, expected in ref.items()]
    pairs += [(candidate.weights[name], expected) for name, expected in reference.weights.items()]
    pairs += [(candidate.buffers[name], expected) for name, expected in reference.buffers.items()]
    losses = [(c, r) for r, c in zip(reference.losses, candidate.losses) if r is not None and c is not None]
    if losses:
        pairs.append(tuple(torch.tensor(series, dtype=torch.float64) for series in zip(*losses)))
    if sum(expected.numel() for _, expected in pairs) > SMALL_RUN:
        return None
    joined: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for actual, expected in pairs:
        if actual is None or actual.shape != expected.shape or (actual.dtype != expected.dtype and actual.is_complex()):
            return None
        actuals, expecteds = joined.setdefault(expected.dtype, ([], []))
        actuals.append(actual.to(expected.dtype).reshape(-1))
        expecteds.append(expected.reshape(-1))
    diffs = [TensorDiff.of(torch.cat(actuals), torch.cat(expecteds), tol) for actuals, expecteds in joined.values()]
    if not all(diff.margin <= 1 for diff in diffs):
        return None
    return (max((d.max_abs for d in diffs), default=0.0), max((d.max_rel for d in diffs), default=0.0),
            max((d.margin for d in diffs), default=0.0))


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a run is compared with as it trains (``train(against=...)``): the reference's recording, at a tolerance,
    each step started from the reference's own state where ``anchors`` names where it saved them."""

    reference: RunResult
    tolerance: Tolerance
    # a folder of the reference's step starts (runners/anchors.py): the run starts each step from them, "" not
    anchors: str = ""
