"""Verdicts: what a check concludes about each (case, regime) pair, and the rules that decide it from a comparison.

A verdict is decided from typed facts (a :class:`~equivcheck.diff.Problem` says its kind), never from the text
that describes them; text is made for people at the edge (``describe``, :mod:`equivcheck.render`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable

from ..case import Case
from ..diff import Comparison, Location, Problem, ProblemKind, kind_of
from ..errors import InvalidArgument, MemoryNotSaved, NotEquivalent, expect_number
from ..regimes import Regime, parse_regime
from ..result import RunResult
from .hints import Hint, diagnose
from .memory import MemoryUse


class Verdict(str, enum.Enum):
    EQUIVALENT = "equivalent"
    MISMATCH = "mismatch"
    EXPECTED_MISMATCH = "expected_mismatch"
    UNEXPECTED_MATCH = "unexpected_match"
    NONDETERMINISTIC = "nondeterministic"
    SKIPPED = "skipped"
    ERROR = "error"
    COMMUNICATION = "communication"  # the numbers match; the regime synchronised more (or less) than it should

    @property
    def as_expected(self) -> bool:
        return self in (Verdict.EQUIVALENT, Verdict.EXPECTED_MISMATCH, Verdict.SKIPPED)


class Status(str, enum.Enum):
    """What a whole report says, worst first: a finding, then a run that could not finish, then nothing run."""

    NOT_AS_EXPECTED = "not_as_expected"  # a mismatch, an unexpected match, a reference that disagrees with itself
    ERROR = "error"  # a run raised, a rank died or hung: part of the check is missing
    NOTHING_CHECKED = "nothing_checked"  # every outcome skipped, or none
    OK = "ok"

    @classmethod
    def of(cls, verdicts: Iterable[Verdict]) -> Status:
        found = set(verdicts)
        if found & {Verdict.MISMATCH, Verdict.UNEXPECTED_MATCH, Verdict.NONDETERMINISTIC, Verdict.COMMUNICATION}:
            return cls.NOT_AS_EXPECTED
        if Verdict.ERROR in found:
            return cls.ERROR
        if found <= {Verdict.SKIPPED}:
            return cls.NOTHING_CHECKED
        return cls.OK


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The verdict on one (case, regime) pair, with the comparison behind it."""

    case: str
    regime: str
    verdict: Verdict
    comparison: Comparison | None = None
    reason: str = ""
    seconds: float = 0.0
    result: RunResult | None = dataclasses.field(default=None, repr=False)
    details: str = dataclasses.field(default="", repr=False)  # the traceback of an error
    memory: MemoryUse | None = None  # peak activation memory beside the reference's

    @property
    def location(self) -> Location | None:
        """Where the run first parts from its reference (step, phase, module), on a comparison that failed."""
        return None if self.comparison is None else self.comparison.location

    def headline(self) -> str:
        """One line: the verdict and where the run parts (else why), what a failed gate says first."""
        head = f"{self.case} under {self.regime}: {self.verdict.value}"
        if self.location is not None:
            return f"{head}, {self.location.describe()}"
        return f"{head} ({self.reason})" if self.reason else head

    def describe(self) -> str:
        head = f"{self.case} under {self.regime}: {self.verdict.value}"
        if self.reason:
            head += f" ({self.reason})"
        if self.comparison is not None and self.verdict is not Verdict.EQUIVALENT:
            head += "\n" + self.comparison.describe()
        return head


@dataclasses.dataclass(frozen=True)
class Report:
    """The outcomes of one or more checks, in the order they ran."""

    outcomes: tuple[Outcome, ...]

    @property
    def ok(self) -> bool:
        return all(o.verdict.as_expected for o in self.outcomes)

    @property
    def status(self) -> Status:
        return Status.of(o.verdict for o in self.outcomes)

    @property
    def failures(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if not o.verdict.as_expected)

    def outcome(self, case: str, regime: str) -> Outcome:
        spec = str(parse_regime(regime))
        for o in self.outcomes:
            if o.case == case and o.regime == spec:
                return o
        raise InvalidArgument.unknown("outcome", f"{case} under {spec}", (f"{o.case} under {o.regime}" for o in self.outcomes))

    def assert_equivalent(self, *, allow_communication: bool = False) -> None:
        """Raise :class:`NotEquivalent` describing every outcome that is not as expected; with
        ``allow_communication``, a regime whose numbers match but whose synchronisation count does not
        passes (a gate on correctness alone)."""
        __tracebackhide__ = True  # pytest: the failure is the caller's line, not this one
        failures = [o for o in self.failures if not (allow_communication and o.verdict is Verdict.COMMUNICATION)]
        if failures:
            lead = "\n".join(o.headline() for o in failures)
            details = "\n\n".join(o.describe() for o in failures)
            raise NotEquivalent(f"{lead}\n\n{len(failures)} of {len(self.outcomes)} checks failed:\n\n{details}")

    def assert_saves_memory(self, regime: str | Regime, max_ratio: float, *, case: str | None = None) -> None:
        """Raise :class:`MemoryNotSaved` unless ``regime`` peaks at most ``max_ratio`` of the reference's
        activation memory in every case checked (or in ``case``)."""
        max_ratio = expect_number("max_ratio", max_ratio, minimum=0, maximum=math.inf, strict=True)
        checked = {o.regime for o in self.outcomes}  # a team step's label ("step:train_step") is no spec to parse
        spec = regime if regime in checked else str(parse_regime(regime))
        chosen = [o for o in self.outcomes if o.regime == spec and case in (None, o.case)]
        if not chosen:
            checked = (f"{o.case} under {o.regime}" for o in self.outcomes)
            raise InvalidArgument.unknown("outcome", f"{case or 'any case'} under {spec}", checked)
        over = [o for o in chosen if o.memory is None or o.memory.ratio is None or o.memory.ratio > max_ratio]
        if over:
            details = "\n".join(f"{o.case} under {o.regime}: "
                                 + (o.memory.describe() if o.memory else f"not measured ({o.verdict.value})")
                                 for o in over)
            raise MemoryNotSaved(f"{len(over)} of {len(chosen)} runs of {spec} peak above {max_ratio:g}x the "
                                 f"reference's activation memory:\n{details}")

    def __add__(self, other: Report) -> Report:
        return Report(self.outcomes + other.outcomes)


def expected_mismatch(case: Case, regime: Regime) -> str | None:
    """The reason ``case`` declares that ``regime`` must mismatch, by exact spec or by regime name."""
    return case.expect_mismatch.get(str(regime), case.expect_mismatch.get(regime.name))


CLIPPED = 1e-4  # clip_grad_norm_ leaves the norm at max_norm * total / (total + 1e-6): within this of max_norm


def _clipping_note(case: Case, regime: Regime, result: RunResult) -> str:
    """Whether a clipping regime's clipping engaged: a clipped reference whose norm never reaches its
    max_norm (scaled by the case's ``clip_scale``) checks nothing about clipping. Engaged = the gradient the step
    used has norm max_norm."""
    max_norm = regime.clips_at()
    if max_norm is None or not result.grad_norms:
        return ""
    threshold = case.clipping_threshold(max_norm)
    norms = result.grad_norms
    engaged = sum(norm >= threshold * (1 - CLIPPED) for norm in norms)
    scaled = f" at {threshold:g} (clip_scale {case.clip_scale:g})" if case.clip_scale is not None else ""
    return f"{regime}: clipping engaged{scaled} at {engaged} of {len(norms)} steps"


def judge(case: Case, spec: Regime, comparison: Comparison, seconds: float, result: RunResult,
           reference: RunResult, reference_regime: Regime) -> Outcome:
    problems = _distributed_problems(spec, result, comparison)
    if problems:
        comparison = dataclasses.replace(comparison, problems=comparison.problems + problems)
    comparison = diagnose(reference, result, comparison)
    if not comparison.ok and not comparison.hint and _synced_every_backward(spec, result):
        comparison = dataclasses.replace(comparison, hint=NO_SYNC)
    reason = expected_mismatch(case, spec)
    if reason is None:
        verdict = Verdict.EQUIVALENT if comparison.ok else _failed(comparison)
        reason = comparison.note if comparison.ok else _only_gradients(comparison)
    else:
        verdict = Verdict.EXPECTED_MISMATCH if not comparison.ok else Verdict.UNEXPECTED_MATCH
    notes = dict.fromkeys(filter(None, (_clipping_note(case, reference_regime, reference),
                                        _clipping_note(case, spec, result),
                                        _tolerance_note(comparison))))
    reason = "; ".join(filter(None, (reason, *notes)))
    return Outcome(case.name, str(spec), verdict, comparison, reason, seconds, result,
                   memory=MemoryUse.of(spec.micro_batches(case) > 1, result, reference))


def _tolerance_note(comparison: Comparison) -> str:
    """A lossy regime's verdict names the bound it was judged at, and the error it measured."""
    tol = comparison.tolerance
    if not tol.source:
        return ""
    return f"compared at {tol}; measured max abs error {comparison.max_abs:.3g}, margin {comparison.margin:.3g}"


def _failed(comparison: Comparison) -> Verdict:
    """A comparison that failed on communication alone gets its own verdict: a gate may choose."""
    if not comparison.mismatches and all(kind_of(p) is ProblemKind.COMMUNICATION for p in comparison.problems):
        return Verdict.COMMUNICATION
    return Verdict.MISMATCH


def _only_gradients(comparison: Comparison) -> str:
    if comparison.mismatches and {m.kind for m in comparison.mismatches} == {"grad"} and not comparison.problems:
        return ("only the gradients recorded at optimizer.step() differ; the final weights and the losses match "
                "(the optimizer absorbed the difference, as Adam does a constant scale, or the step changed the "
                "gradients after they were recorded)")
    return ""


NO_SYNC = Hint(("communication",), "every backward through a DDP model all-reduces its gradients unless it runs under "
              "model.no_sync(): a step that accumulates runs every micro-batch's backward but the last under no_sync()")


def _synced_every_backward(spec: Regime, result: RunResult) -> bool:
    """Whether a DDP run all-reduced more often than a faithful step: no_sync() left out."""
    if spec.syncs_per_step is None or not result.syncs or spec.sync_collective != "all-reduced":
        return False
    return any(syncs > spec.syncs_per_step * (result.sync_wrappers or 1) for syncs in result.syncs)


def _distributed_problems(spec: Regime, result: RunResult, comparison: Comparison) -> tuple[Problem, ...]:
    """What numbers alone miss: replicas that drifted apart, and communication a regime should not make."""
    problems = []
    if result.rank_spread is not None and result.rank_spread > comparison.tolerance.atol:
        where = f" (at {result.rank_drift})" if result.rank_drift else ""
        problems.append(Problem(ProblemKind.RANK_DRIFT,
                                f"ranks disagree: their final weights differ by up to {result.rank_spread:.3g}{where}"))
    if spec.syncs_per_step is not None and result.syncs is not None:
        wrappers = result.sync_wrappers or 1
        expected = spec.syncs_per_step * wrappers
        each = f" ({spec.syncs_per_step} per wrapped module, {wrappers} wrapped)" if wrappers > 1 else ""
        for step, syncs in enumerate(result.syncs):
            if syncs != expected:
                problems.append(Problem(
                    ProblemKind.COMMUNICATION,
                    f"communication: step {step} {spec.sync_collective} gradients {syncs} time(s) "
                    f"({result.sync_bytes[step]} bytes per rank); a faithful step does it {expected} time(s){each}"))
                break
    declared = spec.declared_collectives()
    if declared is not None and result.collectives is not None:
        for step, made in enumerate(result.collectives):
            if {kind: calls for kind, (calls, _) in made.items() if calls} != declared:
                problems.append(Problem(
                    ProblemKind.COMMUNICATION,
                    f"communication: step {step} made {_collectives(made) or 'no collective'}; the spec declares "
                    f"{_collectives({kind: (calls, None) for kind, calls in declared.items()}) or 'none'}"))
                break
    return tuple(problems)


def _collectives(made: dict[str, tuple[int, int | None]]) -> str:
    """``all_reduce[tp] 2 times (576 bytes per rank), all_gather[dp] 1 time (...)``, kinds sorted."""
    return ", ".join(f"{kind} {calls} time{'s' * (calls != 1)}" + ("" if sent is None else f" ({sent} bytes per rank)")
                     for kind, (calls, sent) in sorted(made.items()) if calls)
