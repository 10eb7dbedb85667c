"""Distributed evaluation: a team's metric computed on W ranks against the same metric in one process.

``check_eval(case, evaluate, world_size=W)`` calls ``evaluate(model, dataset)`` once in this process, with
no process group, and once on every rank of the warm pool's W-rank group, where the team's own sampler
and all-reduce decide what each rank sees and how the ranks' parts combine. A faithful evaluation gives
every rank the single-process value, up to rounding. Two bugs are common: ``DistributedSampler`` pads the
last shard by repeating samples (they count twice), and an average of per-rank averages weights uneven
shards equally; both show only where the samples do not divide evenly over the ranks.

Why ``evaluate(model, dataset)`` on the freshly built model: what goes wrong in distributed evaluation is
how the data is split and the parts reduced, not the weights. The model built from the case's seed is the
same on every rank and in the reference without training it W + 1 times, and every sample still moves
the metric. It arrives in eval mode, under ``torch.no_grad()``; ``dataset`` is one epoch of the case's data
as a ``TensorDataset``, so the team's own ``DataLoader`` and sampler run on it unchanged. ``evaluate``
returns a number or a dict of numbers (its metrics by name), and runs with and without a process group
(``dist.is_initialized()``), as code that runs under torchrun and under plain python does.
"""

from __future__ import annotations

import dataclasses
import math

from .case import Case
from .diff import Location
from .judge.eval_location import locate_eval
from .precision import Tolerance
from .runners.ranks import launcher, pool
from .runners.ranks.jobs import EvalJob
from .errors import (BlindSpotWarning, InvalidArgument, NotEquivalent, Unavailable, expect_callable, expect_int,
                     expect_seed, expect_timeout, warn)
from .runners.evaluate import EvaluateFn, evaluate
from .regimes.ddp import Ddp
from .process.import_paths import import_path
from .registry import importable_source, resolve_case
from .device import DEFAULT_DEVICE
from .process.seeding import DEFAULT_SEED
from .process import threads as intra_op


@dataclasses.dataclass(frozen=True)
class MetricDiff:
    """One metric on W ranks against one process: the value furthest from it and its margin."""

    name: str
    single: float
    ranks: tuple[float, ...]
    allowed: float  # atol + rtol * |single|

    @property
    def difference(self) -> float:
        return max(abs(value - self.single) for value in self.ranks)

    @property
    def margin(self) -> float:
        return self.difference / self.allowed

    @property
    def ok(self) -> bool:
        return self.margin <= 1

    def describe(self) -> str:
        ranks = ", ".join(f"{value:.10g}" for value in self.ranks)
        agree = len(set(self.ranks)) == 1
        on_ranks = f"{self.ranks[0]:.10g} on every rank" if agree else f"per rank {ranks}"
        return (f"{self.name!r}: {self.single:.10g} in one process, {on_ranks}: difference {self.difference:.3g} "
                f"(up to {self.allowed:.3g} allowed), margin {self.margin:.3g}")


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """What ``check_eval`` found: every metric's difference, and what kept them from being compared."""

    case: str
    evaluate: str
    world_size: int
    samples: int
    tolerance: Tolerance
    metrics: tuple[MetricDiff, ...]
    problems: tuple[str, ...] = ()
    hint: str = ""
    location: Location | None = None  # where the ranks' metric parts from one process's (judge/eval_location.py)
    unlocated: str = ""  # why no location is said, where the metric parts and none is

    @property
    def ok(self) -> bool:
        return not self.problems and all(m.ok for m in self.metrics)

    @property
    def margin(self) -> float:
        return max((m.margin for m in self.metrics), default=0.0)

    def metric(self, name: str) -> MetricDiff:
        for found in self.metrics:
            if found.name == name:
                return found
        raise InvalidArgument.unknown("metric", name, (m.name for m in self.metrics))

    def describe(self) -> str:
        verdict = "equivalent" if self.ok else "not equivalent"
        lines = [f"{self.case}: {self.evaluate} on {self.world_size} ranks vs one process ({self.samples} samples): "
                 f"{verdict} ({self.tolerance}), margin {self.margin:.3g}"]
        if self.hint and not self.ok:
            lines.append(f"hint: {self.hint}")
        if self.location is not None or self.unlocated:
            lines.append(f"where: {self.location.describe() if self.location is not None else self.unlocated}")
        lines += self.problems
        lines += [m.describe() for m in self.metrics]
        return "\n".join(lines)

    def assert_equivalent(self) -> None:
        """Raise :class:`NotEquivalent` unless every metric on every rank matches the single-process one."""
        if not self.ok:
            raise NotEquivalent(self.describe())


def check_eval(case: Case | str, evaluate_fn: EvaluateFn, *, world_size: int = 2, rtol: float | None = None,
               atol: float | None = None, seed: int = DEFAULT_SEED, backend: str = "auto",
               timeout: float = pool.DEFAULT_TIMEOUT) -> EvalReport:
    """Compare ``evaluate_fn(model, dataset)`` on ``world_size`` ranks with the same call in this process.

    ``model`` is the case's freshly built model (eval mode, no gradients), not a trained one: the bugs are in
    how the data is split and the parts reduced, and a fresh model is the same everywhere without training
    it W + 1 times. ``dataset`` is one epoch of the case's data (a TensorDataset) for the team's own sampler.

    The ranks import ``evaluate_fn`` and the case by name (both at the top level of a module, the case
    registered). Tolerance: ``rtol``/``atol``, else the case's, else its dtype's. Every rank's value is
    compared: a metric the ranks never all-reduced shows as ranks that disagree.
    """
    case = resolve_case(case)
    expect_callable("evaluate", evaluate_fn)
    path = import_path(evaluate_fn, "evaluate")
    expect_int("world_size", world_size)
    group = Ddp(world_size=world_size, backend=backend)  # the process group DDP would use: gloo on CPUs
    expect_seed(seed)
    expect_timeout(timeout)
    rtol, atol = (case.rtol, case.atol) if rtol is None and atol is None else (rtol, atol)
    tolerance = Tolerance.resolve(case.dtype, rtol, atol)
    source = importable_source(case)
    missing = group.unavailable()
    if missing:
        raise Unavailable(missing)

    def both(records: bool) -> tuple[dict, list[dict]]:
        """The evaluation in this process and on every rank (recording the samples each side's model was fed)."""
        with intra_op.using(intra_op.resolve(None)):
            single = evaluate(case, evaluate_fn, seed=seed, records=records)
        job = EvalJob(case.name, source, path, seed, records)
        backend = group.placement(DEFAULT_DEVICE).backend
        if launcher.active():
            return single, launcher.run_job(backend, world_size, job)
        return single, pool.run_job(backend, world_size, job, timeout)

    single, replies = both(records=False)
    report = _compare(case, path, world_size, single, replies, tolerance)
    if not report.ok:  # evaluated again, recording what each side's model was fed: where it parts
        report = _located(report, *both(records=True), tolerance)
    if single["samples"] % world_size == 0:
        warn(BlindSpotWarning(
            f"case {case.name!r} holds {single['samples']} samples, which divide evenly over {world_size} ranks: a "
            "DistributedSampler pads nothing and every shard holds as many samples, so neither padding nor an "
            "average of per-rank averages can show; use a sample count that leaves a remainder"))
    return report


def _compare(case: Case, path: str, world_size: int, single: dict, replies: list[dict],
             tolerance: Tolerance) -> EvalReport:
    expected = single["metrics"]
    problems = [f"rank {rank} returned metrics {sorted(reply['metrics'])}, one process {sorted(expected)}"
                for rank, reply in enumerate(replies) if reply["metrics"].keys() != expected.keys()]
    metrics = tuple(
        MetricDiff(name, value, tuple(reply["metrics"].get(name, math.nan) for reply in replies),
                   tolerance.atol + tolerance.rtol * abs(value))
        for name, value in expected.items())
    for metric in metrics:
        if max(metric.ranks) - min(metric.ranks) > metric.allowed:
            problems.append(f"ranks disagree on {metric.name!r} ({', '.join(f'{v:.6g}' for v in metric.ranks)}): "
                            "each rank reports its own shard's value; the metric was not all-reduced")
    hint = "" if problems else _hint(single["samples"], world_size)  # ranks that disagree say it all
    return EvalReport(case.name, path.partition(":")[2], world_size, single["samples"], tolerance, metrics,
                      tuple(problems), hint)


def _located(report: EvalReport, single: dict, replies: list[dict], tolerance: Tolerance) -> EvalReport:
    """A failed report with where its metric parts, read from a second evaluation that recorded each side's samples
    (the evaluation is deterministic: a fresh model from the seed, the same data); one whose metrics came out
    otherwise the second time says so instead."""
    again = [reply["metrics"] for reply in replies]
    if single["metrics"] != {m.name: m.single for m in report.metrics} or \
            any(tuple(metrics.get(m.name) for metrics in again) != m.ranks for m in report.metrics):
        return dataclasses.replace(report, unlocated="not said: evaluated again to record its samples, it gave other "
                                                     "metrics than the first time")
    location, unlocated = locate_eval(single, replies, tolerance, report.margin)
    return dataclasses.replace(report, location=location, unlocated=unlocated)


def _hint(samples: int, world_size: int) -> str:
    """What an uneven split of ``samples`` over the ranks invites, with its figures."""
    if samples % world_size == 0:
        return ""
    padded = math.ceil(samples / world_size) * world_size
    small, large = samples // world_size, math.ceil(samples / world_size)
    return (f"{samples} samples over {world_size} ranks: a DistributedSampler pads them to {padded}, repeating "
            f"{padded - samples} sample(s) that then count twice (shard without padding, or drop the repeats); "
            f"unpadded shards hold {small} to {large} samples, and an average of per-rank averages weights them "
            "equally (all-reduce the sums and the counts, then divide)")
