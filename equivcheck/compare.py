"""The comparator: every parameter's gradient at every step, the final weights, buffers and losses.

An element matches when ``|actual - expected| <= atol + rtol * |expected|`` (torch.testing's rule).
Its *margin* is the left side over the right: below 1 it matches, and 1 / margin is the headroom.
Every mismatched quantity is reported, not only the first.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .errors import InvalidArgument
from .precision import PRECISIONS, Tolerance
from .result import RunResult


@dataclasses.dataclass(frozen=True)
class TensorDiff:
    """How one actual tensor differs from the expected one (torch.testing.assert_close's figures)."""

    mismatched: int
    total: int
    max_abs: float
    abs_index: tuple[int, ...]
    abs_allowed: float
    max_rel: float
    rel_index: tuple[int, ...]
    margin: float

    @classmethod
    def of(cls, actual: Tensor, expected: Tensor, tol: Tolerance) -> TensorDiff:
        if not expected.numel():  # an empty parameter (a placeholder): nothing to differ
            return cls(0, 0, 0.0, (), 0.0, 0.0, (), 0.0)
        abs_diff = (actual - expected).abs()
        allowed = tol.atol + tol.rtol * expected.abs()
        ratio = torch.nan_to_num(abs_diff / allowed, nan=math.inf)
        rel_diff = torch.nan_to_num(abs_diff / expected.abs(), nan=0.0)  # 0/0: no difference
        rel_diff = torch.where(abs_diff.isnan(), math.inf, rel_diff)
        abs_at = int(torch.nan_to_num(abs_diff, nan=math.inf).argmax())
        rel_at = int(rel_diff.argmax())
        return cls(
            mismatched=int((ratio > 1).sum()),
            total=ratio.numel(),
            max_abs=float(abs_diff.reshape(-1)[abs_at]),
            abs_index=_index(abs_at, expected.shape),
            abs_allowed=float(allowed.reshape(-1)[abs_at]),
            max_rel=float(rel_diff.reshape(-1)[rel_at]),
            rel_index=_index(rel_at, expected.shape),
            margin=float(ratio.max()),
        )


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if len(shape) else ()


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One quantity that differs: ``grad`` or ``weight`` of a parameter, a ``buffer``, or the ``loss``.

    ``first_step`` is the first optimizer step where it diverged (None for final weights and
    buffers); ``diff`` is taken at ``worst_step``, the step with the greatest margin; ``step_margins``
    is the margin at each step (gradients and the loss), the shape of the divergence over training.
    """

    kind: str
    name: str
    first_step: int | None
    worst_step: int | None
    diff: TensorDiff
    step_margins: tuple[float, ...] = ()  # a gradient's (or the loss's) margin at every optimizer step: its divergence

    def describe(self, tol: Tolerance) -> str:
        d = self.diff
        where = "final" if self.first_step is None else f"from step {self.first_step} (worst at step {self.worst_step})"
        index = lambda i: f" at index {i}" if i else ""  # noqa: E731
        return (
            f"{self.kind} of {self.name!r} mismatched {where}:\n"
            f"  Mismatched elements: {d.mismatched} / {d.total} ({d.mismatched / d.total:.1%})\n"
            f"  Greatest absolute difference: {d.max_abs:.3g}{index(d.abs_index)} (up to {d.abs_allowed:.3g} allowed)\n"
            f"  Greatest relative difference: {d.max_rel:.3g}{index(d.rel_index)} (up to {tol.rtol:g} allowed)\n"
            f"  Margin: {d.margin:.3g} (error / allowed error)"
        )


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The verdict of one candidate run against the reference, with every mismatch found."""

    tolerance: Tolerance
    mismatches: tuple[Mismatch, ...]
    problems: tuple[str, ...]  # structural differences: step counts, parameter names or shapes
    max_abs: float
    max_rel: float
    margin: float
    hint: str = ""  # the likely pitfall, where the pattern of mismatches is recognisable: set by hints.diagnose
    note: str = ""  # what float64 shadow runs showed of a low-precision run (rounding.py)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.problems

    @property
    def first_divergent_step(self) -> int | None:
        steps = [m.first_step for m in self.mismatches if m.first_step is not None]
        return min(steps) if steps else None

    def describe(self) -> str:
        note = f"\nnote: {self.note}" if self.note else ""
        if self.ok:
            return f"equivalent: margin {self.margin:.3g} ({self.tolerance}){note}"
        lines = [f"not equivalent ({self.tolerance}): margin {self.margin:.3g}, max abs {self.max_abs:.3g}{note}"]
        if self.hint:
            lines.append(f"hint: {self.hint}")
        lines += self.problems
        lines += [m.describe(self.tolerance) for m in self.mismatches]
        return "\n".join(lines)


def compare(
    reference: RunResult, candidate: RunResult, *, rtol: float | None = None, atol: float | None = None,
    tolerance: Tolerance | None = None,
) -> Comparison:
    """Compare ``candidate`` against ``reference`` everywhere; the tolerance follows the precision mode,
    unless ``rtol`` and ``atol`` or a whole ``tolerance`` (a lossy regime's own bound) are given."""
    if tolerance is not None:
        if not isinstance(tolerance, Tolerance):
            raise InvalidArgument.type("tolerance", tolerance, "an equivcheck.Tolerance")
        tol = tolerance
    else:
        mode = PRECISIONS.get(reference.precision) or next(iter(reference.weights.values())).dtype
        tol = Tolerance.resolve(mode, rtol, atol)
    within = _all_within(reference, candidate, tol)
    if within is not None:  # the common case, in a few vectorised ops; the breakdown is for mismatches
        return Comparison(tol, (), (), *within)
    problems: list[str] = []
    if reference.optimizer_steps != candidate.optimizer_steps:
        problems.append(
            f"optimizer steps: the reference took {reference.optimizer_steps}, "
            f"the candidate {candidate.optimizer_steps}"
        )
    # A quantity maps to one diff per step; steps beyond the shorter run are covered by the problem above.
    series: dict[tuple[str, str], list[tuple[int | None, Tensor, Tensor]]] = {}
    for step, (ref_grads, cand_grads) in enumerate(zip(reference.grads, candidate.grads)):
        for name, expected in ref_grads.items():
            series.setdefault(("grad", name), []).append((step, cand_grads.get(name), expected))
    for kind, ref_map, cand_map in (
        ("weight", reference.weights, candidate.weights),
        ("buffer", reference.buffers, candidate.buffers),
    ):
        if ref_map.keys() != cand_map.keys():
            problems.append(f"{kind} names differ: {sorted(ref_map.keys() ^ cand_map.keys())}")
        for name, expected in ref_map.items():
            series[(kind, name)] = [(None, cand_map.get(name), expected)]
    losses = [(r, c) for r, c in zip(reference.losses, candidate.losses) if r is not None and c is not None]
    if losses:
        ref_l, cand_l = zip(*losses)
        series[("loss", "loss")] = [(None, torch.tensor(cand_l, dtype=torch.float64), torch.tensor(ref_l, dtype=torch.float64))]

    mismatches, max_abs, max_rel, margin = [], 0.0, 0.0, 0.0
    for (kind, name), entries in series.items():
        first = worst = None
        margins = []
        for step, actual, expected in entries:
            if actual is None or actual.shape != expected.shape:
                problems.append(f"{kind} of {name!r}: candidate has {None if actual is None else tuple(actual.shape)}, "
                                f"reference {tuple(expected.shape)}")
                break
            diff = TensorDiff.of(actual.to(expected.dtype), expected, tol)
            max_abs, max_rel, margin = max(max_abs, diff.max_abs), max(max_rel, diff.max_rel), max(margin, diff.margin)
            margins.append(diff.margin)
            if diff.margin > 1:
                if first is None:
                    first = (step, diff)
                if worst is None or diff.margin > worst[1].margin:
                    worst = (step, diff)
        if first is not None:
            if kind == "loss":  # the loss series is one tensor over steps: each element is a step
                step_margins = _element_margins(entries[0], tol)
                worst_step = max(range(len(step_margins)), key=step_margins.__getitem__)
                first_step = next(step for step, step_margin in enumerate(step_margins) if step_margin > 1)
                mismatches.append(Mismatch(kind, name, first_step, worst_step, worst[1], step_margins))
            else:
                mismatches.append(Mismatch(kind, name, first[0], worst[0], worst[1],
                                           tuple(margins) if kind == "grad" else ()))
    return Comparison(tol, tuple(mismatches), tuple(problems), max_abs, max_rel, margin)


def _element_margins(entry: tuple[int | None, Tensor, Tensor], tol: Tolerance) -> tuple[float, ...]:
    """The loss series' margin at each step: one element per step (a NaN is the worst, never a match)."""
    _, actual, expected = entry
    ratio = (actual - expected).abs() / (tol.atol + tol.rtol * expected.abs())
    return tuple(float(r) for r in torch.nan_to_num(ratio, nan=math.inf))


def _all_within(reference: RunResult, candidate: RunResult, tol: Tolerance) -> tuple[float, float, float] | None:
    """``(max_abs, max_rel, margin)`` when both runs have the same structure and every element is within
    ``tol``, computed as :class:`TensorDiff` does but on all tensors of a dtype at once; else None, and
    :func:`compare` takes the per-quantity path that locates every mismatch."""
    if reference.optimizer_steps != candidate.optimizer_steps:
        return None
    pairs = [(cand_grads.get(name), expected)
             for ref_grads, cand_grads in zip(reference.grads, candidate.grads) for name, expected in ref_grads.items()]
    for ref_map, cand_map in ((reference.weights, candidate.weights), (reference.buffers, candidate.buffers)):
        if ref_map.keys() != cand_map.keys():
            return None
        pairs += [(cand_map[name], expected) for name, expected in ref_map.items()]
    losses = [(c, r) for r, c in zip(reference.losses, candidate.losses) if r is not None and c is not None]
    if losses:
        pairs.append(tuple(torch.tensor(series, dtype=torch.float64) for series in zip(*losses)))
    by_dtype: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for actual, expected in pairs:
        if actual is None or actual.shape != expected.shape:
            return None
        if not expected.numel():
            continue  # an empty parameter: nothing to compare
        actuals, expecteds = by_dtype.setdefault(expected.dtype, ([], []))
        actuals.append(actual.to(expected.dtype).reshape(-1))
        expecteds.append(expected.reshape(-1))
    max_abs = max_rel = margin = 0.0
    for actuals, expecteds in by_dtype.values():
        actual, expected = torch.cat(actuals), torch.cat(expecteds)
        abs_diff = (actual - expected).abs()
        ratio = torch.nan_to_num(abs_diff / (tol.atol + tol.rtol * expected.abs()), nan=math.inf)
        group_margin = float(ratio.max())
        if not group_margin <= 1:
            return None
        rel_diff = torch.nan_to_num(abs_diff / expected.abs(), nan=0.0)  # 0/0: no difference
        max_abs, max_rel = max(max_abs, float(abs_diff.max())), max(max_rel, float(rel_diff.max()))
        margin = max(margin, group_margin)
    return max_abs, max_rel, margin
