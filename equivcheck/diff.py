"""What a comparison finds, as types: a tensor's difference (:class:`TensorDiff`), a mismatched quantity
(:class:`Mismatch`), a candidate's whole verdict (:class:`Comparison`), and the :class:`Measurement` that gathers
them as a run trains. Text only at the edge: each says itself in ``describe``.

An element matches when ``|actual - expected| <= atol + rtol * |expected|`` (torch.testing's rule).
Its *margin* is the left side over the right: below 1 it matches, and 1 / margin is the headroom.
A complex tensor's real and imaginary parts are elements of their own, each judged at its own scale, as an
optimizer steps them (``torch.view_as_real``): a change to one part alone is never hidden by the other's size.
Every mismatched quantity is reported, not only the first.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from torch import Tensor

from .arrays import from_array, to_array

from .precision import Tolerance


# Elements a comparison takes at a time: its temporaries stay in cache, whatever the tensor's size.
CHUNK = 1 << 16


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
    complex_parts: bool = False  # of complex tensors: each index ends in the part, 0 real and 1 imaginary

    @classmethod
    def of(cls, actual: Tensor, expected: Tensor, tol: Tolerance) -> TensorDiff:
        """Streamed over slices of :data:`CHUNK` elements, with no temporary of the tensor's size: one scan for
        a tensor within ``tol``, and the breakdown (mismatched elements, NaNs) only for one that is not."""
        if expected.is_complex() or actual.is_complex():  # a real one's imaginary parts are 0
            dtype = expected.dtype.to_complex()
            diff = cls.of(as_real(actual.to(dtype)), as_real(expected.to(dtype)), tol)
            return dataclasses.replace(diff, complex_parts=True)
        if not expected.numel():  # an empty parameter (a placeholder): nothing to differ
            return cls(0, 0, 0.0, (), 0.0, 0.0, (), 0.0)
        flat_actual, flat_expected = actual.to(expected.dtype).reshape(-1), expected.reshape(-1)
        if torch.equal(flat_actual, flat_expected):  # bit for bit (a NaN equals nothing): every difference is 0
            return cls(0, expected.numel(), 0.0, _index(0, expected.shape), _allowed(flat_expected, 0, tol), 0.0,
                       _index(0, expected.shape), 0.0)
        scan = _Scan(flat_actual, flat_expected, tol)
        return scan.within(expected.shape) or scan.breakdown(expected.shape)

    @classmethod
    def joined(cls, parts: list[tuple[int, TensorDiff]], shape: torch.Size) -> TensorDiff:
        """One tensor of ``shape``'s figures from those of its consecutive slices, each taken flat (``(its first
        element, its diff)``): a tensor judged a slice at a time, never whole in memory (runners/anchors.py)."""
        def at(offset: int, index: tuple[int, ...]) -> tuple[int, ...]:  # the slice's index (ending in the part,
            return _index(offset + index[0], shape) + index[1:] if index else ()  # complex) in the whole tensor

        def ranked(figure: float) -> float:  # a NaN difference is the greatest, as the breakdown ranks it
            return math.inf if math.isnan(figure) else figure

        abs_at, greatest_abs = max(parts, key=lambda part: ranked(part[1].max_abs))  # a tie: the first slice's
        rel_at, greatest_rel = max(parts, key=lambda part: ranked(part[1].max_rel))
        return cls(sum(d.mismatched for _, d in parts), sum(d.total for _, d in parts), greatest_abs.max_abs,
                   at(abs_at, greatest_abs.abs_index), greatest_abs.abs_allowed, greatest_rel.max_rel,
                   at(rel_at, greatest_rel.rel_index), max(d.margin for _, d in parts), parts[0][1].complex_parts)


class _Scan:
    """One pass over a pair of flat tensors, slice by slice, into buffers of one slice: the greatest error
    ratio, absolute and relative difference, and the slice where each first occurs."""

    def __init__(self, actual: Tensor, expected: Tensor, tol: Tolerance) -> None:
        self.actual, self.expected, self.tol = actual, expected, tol
        size = min(CHUNK, expected.numel())
        self._diff, self._magnitude, self._ratio = (expected.new_empty(size) for _ in range(3))

    def _slices(self) -> Iterator[tuple[int, Tensor, Tensor]]:
        for start in range(0, self.expected.numel(), CHUNK):
            yield start, self.actual[start : start + CHUNK], self.expected[start : start + CHUNK]

    def within(self, shape: torch.Size) -> TensorDiff | None:
        """The figures of a tensor whose every element is within tolerance, else None (a NaN included)."""
        margin, greatest_abs, greatest_rel = 0.0, (-1.0, 0), (-1.0, 0)  # (greatest, the first slice holding it)
        for start, actual, expected in self._slices():
            n = len(expected)
            diff, magnitude, ratio = self._diff[:n], self._magnitude[:n], self._ratio[:n]
            torch.sub(actual, expected, out=diff).abs_()
            torch.abs(expected, out=magnitude)
            torch.mul(magnitude, self.tol.rtol, out=ratio).add_(self.tol.atol)  # what each element may differ by
            torch.div(diff, ratio, out=ratio)
            top = float(ratio.max())
            if not top <= 1:  # beyond tolerance, a NaN, or 0 / 0 where nothing is allowed: the breakdown decides
                return None
            margin = max(margin, top)
            greatest_abs = _greater(greatest_abs, float(diff.max()), start)
            torch.div(diff, magnitude, out=ratio).nan_to_num_(nan=0.0)  # 0 / 0: no difference
            greatest_rel = _greater(greatest_rel, float(ratio.max()), start)
        # Where in its slice each greatest first occurs: that one slice computed again, as the scan computed it.
        abs_at = self._first_greatest_in(greatest_abs[1], relative=False)
        rel_at = self._first_greatest_in(greatest_rel[1], relative=True)
        return TensorDiff(0, self.expected.numel(), greatest_abs[0], _index(abs_at, shape),
                          _allowed(self.expected, abs_at, self.tol), greatest_rel[0], _index(rel_at, shape), margin)

    def _first_greatest_in(self, start: int, relative: bool) -> int:
        """The index in the whole tensor of the first greatest absolute (or relative) difference in the slice at
        ``start``: one slice's argmax, not one per slice of the scan."""
        actual, expected = self.actual[start : start + CHUNK], self.expected[start : start + CHUNK]
        values = torch.sub(actual, expected).abs_()
        if relative:
            values = torch.div(values, torch.abs(expected)).nan_to_num_(nan=0.0)
        return -_first_greatest(values, start)[1]

    def breakdown(self, shape: torch.Size) -> TensorDiff:
        """Every figure of a tensor with elements beyond tolerance: NaNs are the greatest difference."""
        mismatched, margin, greatest_abs, greatest_rel = 0, 0.0, (-math.inf, 0, 0.0), (-math.inf, 0, 0.0)
        for start, actual, expected in self._slices():
            abs_diff = (actual - expected).abs()
            ratio = torch.nan_to_num(abs_diff / (self.tol.atol + self.tol.rtol * expected.abs()), nan=math.inf)
            ratio = torch.where(abs_diff == 0, 0.0, ratio)  # equal is 0 even where nothing is allowed
            rel_diff = torch.nan_to_num(abs_diff / expected.abs(), nan=0.0)  # 0/0: no difference
            rel_diff = torch.where(abs_diff.isnan(), math.inf, rel_diff)
            ranked = torch.nan_to_num(abs_diff, nan=math.inf)
            abs_at, rel_at = int(ranked.argmax()), int(rel_diff.argmax())
            mismatched += int((ratio > 1).sum())
            margin = max(margin, float(ratio.max()))
            greatest_abs = max(greatest_abs, (float(ranked[abs_at]), -start - abs_at, float(abs_diff[abs_at])))
            greatest_rel = max(greatest_rel, (float(rel_diff[rel_at]), -start - rel_at, float(rel_diff[rel_at])))
        abs_at, rel_at = -greatest_abs[1], -greatest_rel[1]
        return TensorDiff(mismatched, self.expected.numel(), greatest_abs[2], _index(abs_at, shape),
                          _allowed(self.expected, abs_at, self.tol), greatest_rel[2], _index(rel_at, shape), margin)


def as_real(tensor: Tensor) -> Tensor:
    """``tensor``, or a complex one as its real and imaginary parts along a last dimension of 2 (a view): each part
    an element of its own."""
    return torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor


def _greater(best: tuple[float, int], value: float, start: int) -> tuple[float, int]:
    """``(value, start)`` where ``value`` is greater than ``best``'s: on a tie the earlier slice keeps it."""
    return (value, start) if value > best[0] else best


def _first_greatest(values: Tensor, start: int) -> tuple[float, int]:
    """``(greatest value, -its index in the whole tensor)``: the first of equal ones ranks highest, as argmax's."""
    top, at = values.max(dim=0)
    return float(top), -(start + int(at))


def _allowed(expected: Tensor, flat: int, tol: Tolerance) -> float:
    """What the element at ``flat`` may differ by, computed in its dtype as the scan computes it."""
    return float(tol.atol + tol.rtol * expected[flat : flat + 1].abs())


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The index of element ``flat`` of a contiguous tensor of ``shape`` (torch.unravel_index's, without a tensor)."""
    index = []
    for size in reversed(shape):
        flat, at = divmod(flat, size)
        index.append(at)
    return tuple(reversed(index))


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
        index = functools.partial(_at, parts=d.complex_parts)
        counted = " (real and imaginary parts counted apart)" if d.complex_parts else ""
        return (
            f"{self.kind} of {self.name!r} mismatched {where}:\n"
            f"  Mismatched elements: {d.mismatched} / {d.total} ({d.mismatched / d.total:.1%}){counted}\n"
            f"  Greatest absolute difference: {d.max_abs:.3g}{index(d.abs_index)} (up to {d.abs_allowed:.3g} allowed)\n"
            f"  Greatest relative difference: {d.max_rel:.3g}{index(d.rel_index)} (up to {tol.rtol:g} allowed)\n"
            f"  Margin: {d.margin:.3g} (error / allowed error)"
        )


def _at(index: tuple[int, ...], parts: bool) -> str:
    """Where an element is, said after a figure: a complex tensor's index ends in the part."""
    if not parts:
        return f" at index {index}" if index else ""
    return f" in the {('real', 'imaginary')[index[-1]]} part" + _at(index[:-1], parts=False)


# The tensor a location names where the run's modules computed in another dtype than the reference's
COMPUTED_IN = "the precision it computed in"

# The phases of an optimizer step, in the order it runs them, where a run can first part from its reference; an
# evaluation parts in its forward or after it, in the metric made of the model's outputs (judge/eval_location.py).
PHASES = ("forward", "loss", "backward", "gradient", "communication", "optimizer", "state", "compiler", "metric")


@dataclasses.dataclass(frozen=True)
class Location:
    """The first place a run leaves its reference: optimizer ``step`` (None: an evaluation, which takes none),
    ``phase`` (one of :data:`PHASES`) and
    ``module`` (a dotted name in the case's model; "" for the root, or where no module applies), with the evidence:
    the ``tensor`` that differs first and its ``margin``, and what was seen to match around it (``matched``).
    ``own_code``: the module's children compute alike from what they are given, so the difference is made in the
    module's own code between them. ``forwards``: the model's calls on one rank in the traced step (its micro-batches;
    None where its modules were not traced), which says what a hint may presume the step has. ``below_tolerance``: it
    parts here by less than the verdict's tolerance, and fails the verdict later (judge/noise_floor.py). ``in_shards``:
    the parameter it names was held in shards, each rank's optimizer stepping its own (FSDP2, tensor parallelism)."""

    step: int | None
    phase: str
    module: str
    tensor: str
    margin: float | None = None
    matched: str = ""
    own_code: bool = False
    forwards: int | None = None
    below_tolerance: bool = False  # found at float64's noise floor, before the run first fails the verdict
    in_shards: bool = False  # an optimizer location: its parameter stepped shard by shard on the ranks

    def describe(self) -> str:
        where = f" in `{self.module}`" if self.module else ""
        margin = "" if self.margin is None else f", margin {self.margin:.3g}"
        matched = f"; {self.matched}" if self.matched else ""
        when = "in evaluation" if self.step is None else f"at step {self.step}"
        return f"parts {when}, {self.phase}{where} ({self.tensor} differs{margin}{matched})"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The verdict of one candidate run against the reference, with every mismatch found."""

    tolerance: Tolerance
    mismatches: tuple[Mismatch, ...]
    problems: tuple[str, ...]  # structural differences (each a Problem, with its kind): step counts, names, shapes
    max_abs: float
    max_rel: float
    margin: float
    hint: str = ""  # the likely pitfall, where the pattern of mismatches is recognisable: set by hints.diagnose
    note: str = ""  # how a low-precision run was judged: what float64 shadows showed (rounding.py), or anchored
    location: Location | None = None  # where the run first parts from the reference (judge/locate/)

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
        if not self.mismatches and all(kind_of(p) is ProblemKind.COMMUNICATION for p in self.problems):
            lines = [f"the numbers match (margin {self.margin:.3g}, {self.tolerance}); the communication differs{note}"]
        else:
            lines = [f"not equivalent ({self.tolerance}): margin {self.margin:.3g}, max abs {self.max_abs:.3g}{note}"]
        if self.location is not None:
            downstream = len(self.mismatches)
            lines.append(self.location.describe() + (f"; the {downstream} mismatched quantities below differ from "
                                                     "there on (propagated)" if downstream > 1 else ""))
        if self.hint:
            lines.append(f"hint: {self.hint}")
        lines += self.problems
        lines += [m.describe(self.tolerance) for m in self.mismatches]
        return "\n".join(lines)


class ProblemKind(str, enum.Enum):
    """What kind of structural difference a problem is: the verdict rules and the renderers read this, never the text."""

    STEPS = "optimizer steps"  # the candidate stepped the optimizer another number of times
    NAMES = "names"  # its parameters or buffers have other names
    SHAPE = "shape"  # a quantity has another shape
    RANK_DRIFT = "ranks disagree"  # replicas that should hold the same weights drifted apart
    COMMUNICATION = "communication"  # the numbers match; the synchronisation count does not
    UNSTABLE = "disagrees with itself"  # compared as it trained it mismatched; trained again, it matched


class Problem(str):
    """A structural difference that numbers alone do not show, with its :class:`ProblemKind`. A ``str`` (its text),
    so that it reads, prints and compares as the problems always have; rules read ``kind``."""

    kind: ProblemKind

    def __new__(cls, kind: ProblemKind, text: str) -> Problem:
        problem = super().__new__(cls, text)
        problem.kind = ProblemKind(kind)
        return problem

    def __getnewargs__(self) -> tuple[ProblemKind, str]:  # pickled across processes with its kind
        return (self.kind, str(self))


def kind_of(problem: str) -> ProblemKind | None:
    """A problem's kind; None for plain text (a comparison built by hand)."""
    return getattr(problem, "kind", None)


class Trained(Protocol):
    """What a measurement reads of a run beside its tensors (a :class:`~equivcheck.result.RunResult` has it)."""

    optimizer_steps: int
    losses: tuple[float | None, ...]


SCALER_PREFIX = "GradScaler."  # the buffers a run's GradScaler state is compared under (runners/train.py)


def _scalers_alike(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]):
    """A GradScaler's state is compared where both runs stepped through one; where only one did (a team's step,
    which keeps a scaler of its own, against the reference; a scaled run against a plain one), their models only."""
    def scaler(named: Mapping[str, Tensor]) -> bool:
        return any(name.startswith(SCALER_PREFIX) for name in named)

    if scaler(actual) == scaler(expected):
        return actual, expected
    return tuple({n: t for n, t in named.items() if not n.startswith(SCALER_PREFIX)} for named in (actual, expected))


class Measurement:
    """Every quantity's difference from the reference, taken as it comes: each step's gradients (while a run
    trains, where it is compared as it goes), then the final weights and buffers. No tensor is kept but a final
    weight beyond the tolerance (``strayed``, one model's weights at most): where the reference's own rounding
    explains it (witness.by_the_reference), no run is needed to read it again."""

    def __init__(self, tolerance: Tolerance) -> None:
        self.tolerance = tolerance
        # A quantity maps to one diff per step; a quantity whose shape is off stops there, with its problem.
        self.series: dict[tuple[str, str], list[tuple[int | None, TensorDiff]]] = {}
        self.broken: dict[tuple[str, str], Problem] = {}
        self.names: list[Problem] = []  # weight or buffer names that differ
        self.strayed: dict[str, Tensor] = {}  # the final weights beyond the tolerance, as plain CPU copies
        self.unanchored = ""  # a run meant to start each step from the reference's state that did not: why

    def __getstate__(self) -> dict:
        """Crossing processes (a rank's, the isolating child's), the kept weights go as numpy arrays: a tensor would
        go as shared memory, which a process that already ended cannot serve."""
        return {**self.__dict__, "strayed": {name: to_array(t) for name, t in self.strayed.items()}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, strayed={name: from_array(a) for name, a in state["strayed"].items()})

    def add(self, kind: str, step: int | None, actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
        """The differences of ``actual`` from ``expected``, name by name (``step`` None: final values)."""
        for name, wanted in expected.items():
            key = (kind, name)
            self.series.setdefault(key, [])  # a quantity whose shape is off is listed, with its problem
            if key in self.broken:
                continue
            got = actual.get(name)
            if got is None or got.shape != wanted.shape:
                self.broken[key] = Problem(ProblemKind.SHAPE, f"{kind} of {name!r}: candidate has "
                                           f"{None if got is None else tuple(got.shape)}, reference {tuple(wanted.shape)}")
                continue
            diff = TensorDiff.of(got.to(wanted.device), wanted, self.tolerance)
            self.add_diff(kind, step, name, diff)
            if kind == "weight" and step is None and diff.margin > 1:
                self.strayed[name] = got.detach().to("cpu", copy=True)

    def add_diff(self, kind: str, step: int | None, name: str, diff: TensorDiff) -> None:
        """A difference taken already (a tensor judged a slice at a time: :meth:`TensorDiff.joined`)."""
        self.series.setdefault((kind, name), []).append((step, diff))

    def add_final(self, kind: str, actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
        """The final ``kind`` (``'weight'`` or ``'buffer'``), whose names must be the reference's too."""
        if kind == "buffer":
            actual, expected = _scalers_alike(actual, expected)
        if actual.keys() != expected.keys():
            self.names.append(Problem(ProblemKind.NAMES, f"{kind} names differ: {sorted(actual.keys() ^ expected.keys())}"))
        self.add(kind, None, actual, expected)


    def conclude(self, reference: Trained, candidate: Trained) -> Comparison:
        """The comparison: the step counts, every quantity's first and worst step, the loss series."""
        tol = self.tolerance
        problems: list[Problem] = []
        if reference.optimizer_steps != candidate.optimizer_steps:
            problems.append(Problem(ProblemKind.STEPS, f"optimizer steps: the reference took {reference.optimizer_steps}, "
                                                       f"the candidate {candidate.optimizer_steps}"))
        problems += self.names
        series = dict(self.series)
        losses = [(r, c) for r, c in zip(reference.losses, candidate.losses) if r is not None and c is not None]
        if losses:
            ref_l, cand_l = (torch.tensor(values, dtype=torch.float64) for values in zip(*losses))
            series[("loss", "loss")] = [(None, TensorDiff.of(cand_l, ref_l, tol))]
        mismatches, max_abs, max_rel, margin = [], 0.0, 0.0, 0.0
        for (kind, name), entries in series.items():
            first = worst = None
            for step, diff in entries:
                max_abs, max_rel, margin = max(max_abs, diff.max_abs), max(max_rel, diff.max_rel), max(margin, diff.margin)
                if diff.margin > 1:
                    if first is None:
                        first = (step, diff)
                    if worst is None or diff.margin > worst[1].margin:
                        worst = (step, diff)
            if (kind, name) in self.broken:
                problems.append(self.broken[(kind, name)])
            if first is None:
                continue
            if kind == "loss":  # the loss series is one tensor over steps: each element is a step
                step_margins = _element_margins(cand_l, ref_l, tol)
                worst_step = max(range(len(step_margins)), key=step_margins.__getitem__)
                first_step = next(step for step, step_margin in enumerate(step_margins) if step_margin > 1)
                mismatches.append(Mismatch(kind, name, first_step, worst_step, worst[1], step_margins))
            else:
                mismatches.append(Mismatch(kind, name, first[0], worst[0], worst[1],
                                           tuple(diff.margin for _, diff in entries) if kind == "grad" else ()))
        return Comparison(tol, tuple(mismatches), tuple(problems), max_abs, max_rel, margin)


def _element_margins(actual: Tensor, expected: Tensor, tol: Tolerance) -> tuple[float, ...]:
    """The loss series' margin at each step: one element per step (a NaN is the worst, never a match)."""
    ratio = (actual - expected).abs() / (tol.atol + tol.rtol * expected.abs())
    return tuple(float(r) for r in torch.nan_to_num(ratio, nan=math.inf))
