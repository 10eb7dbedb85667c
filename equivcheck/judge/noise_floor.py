"""Evidence below the verdict's tolerance: where a failed float64 run already parted, before it first failed.

The verdict keeps its tolerance (a float64 check allows 1e-7, float32's rounding and more). A difference smaller
than that can still be real and grow: a team's activation a hair off parts from the reference at step 0 and fails
the verdict only steps later, where the localizer, at the verdict's tolerance, would name a later step and say that
every gradient before it matches. So once a check has failed, its float64 gradients are read again at float64's own
noise floor (a thousand ulps, widened to what the reference's repeat showed): the earliest step that parts there,
where it is earlier than the verdict's, is walked at that floor, and its location says both: where it parts, under
the verdict's tolerance, and where it first fails the verdict. Lower precisions have no floor read here: their
rounding is the witness's to measure, and the location stays the verdict's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..diff import Comparison, Location, TensorDiff
from ..precision import Tolerance
from ..result import RunResult

ULPS = 1000  # float64's noise floor, in units of its rounding: far above a reordered sum's, far below float32's
FLOAT64_ROUNDING = torch.finfo(torch.float64).eps


def floor_of(comparison: Comparison, reference: RunResult, repeat_apart: float) -> Tolerance | None:
    """The tolerance of float64's noise floor for this check, widened to the reference's own repeat
    (``repeat_apart``: its greatest absolute difference from run to run); None for a check not judged at float64's
    rounding (another precision, a lossy regime's widened tolerance)."""
    first = next(iter(reference.grads[0].values()), None) if reference.grads else None
    if first is None or first.dtype != torch.float64 or reference.precision not in ("", "float64") \
            or comparison.tolerance.source:
        return None
    floor = ULPS * FLOAT64_ROUNDING
    floor_tolerance = Tolerance(floor, max(floor, 10 * repeat_apart),
                                f"float64's noise floor ({ULPS} ulps: rtol={floor:.2g})")
    return floor_tolerance if floor_tolerance.atol < comparison.tolerance.atol else None


def first_step_apart(reference: RunResult, candidate: RunResult, tolerance: Tolerance, before: int) -> int | None:
    """The first step before ``before`` where some gradient both runs recorded differs at ``tolerance``."""
    for step in range(min(before, len(reference.grads), len(candidate.grads))):
        for name, expected in reference.grads[step].items():
            actual = candidate.grads[step].get(name)
            if actual is not None and actual.shape == expected.shape and \
                    TensorDiff.of(actual, expected, tolerance).margin > 1:
                return step
    return None


def earlier(found: Location, comparison: Comparison, reference: RunResult, candidate: RunResult,
            repeat_apart: float, walk: Callable[[int, Tolerance], Location | None]) -> Location | None:
    """Where a failed run parts at float64's noise floor, where that is before ``found`` (the verdict's location):
    ``walk(step, tolerance)`` walks a step's traces at a tolerance. None where no earlier step parts there, or its
    walk says nothing (then ``found`` stands)."""
    floor = floor_of(comparison, reference, repeat_apart)
    step = None if floor is None else first_step_apart(reference, candidate, floor, found.step)
    if step is None:
        return None
    located = walk(step, floor)
    if located is None or located.step >= found.step:
        return None
    margin = "" if located.margin is None else f"margin {located.margin:.3g} "
    where = f" in `{found.module}`" if found.module else ""
    return dataclasses.replace(located, margin=None, below_tolerance=True, matched="; ".join(filter(None, (
        f"{margin}at {floor.source}, under the verdict's tolerance ({comparison.tolerance})",
        located.matched,
        f"it first fails the verdict at step {found.step}, {found.phase}{where}"))))
