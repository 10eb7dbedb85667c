"""Where a run goes: ``run`` trains a case under a regime in this process, on the warm pool's worker
ranks, or in a launcher's process group, and returns one RunResult whichever it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..case import Case
from ..judge.compare import Expected
from .ranks import launcher, pool, shared_reference
from .ranks.jobs import TrainJob
from ..errors import InvalidArgument, Unavailable, expect_timeout
from .isolation import IsolatedRunner
from ..regimes import Regime, parse_regime
from ..registry import importable_source, resolve_case
from ..result import RunResult
from .request import RunRequest
from .resume import train_resumed
from .train import drift_place, run_request
from ..process.seeding import DEFAULT_SEED

DEFAULT_TIMEOUT = pool.DEFAULT_TIMEOUT


def run(case: Case | str, regime: Regime | str, *, seed: int = DEFAULT_SEED, timeout: float = DEFAULT_TIMEOUT,
        isolate: bool = False, **options) -> RunResult:
    """Train ``case`` for its steps under ``regime`` from the seeded start and return what it produced.

    Raises :class:`Unavailable` when this machine cannot run the regime (no GPUs for nccl or
    DataParallel), :class:`WorkerError` when a worker rank raises, hangs past ``timeout`` or dies.
    ``isolate=True`` trains an in-process run in a forked child: a run that kills its process raises
    :class:`RunDied` here instead of ending this process.
    """
    if not isolate:
        return start(case, regime, seed=seed, timeout=timeout, **options).result()
    case, regime = resolve_case(case), parse_regime(regime)
    runner = IsolatedRunner([(case, [regime])])
    try:
        return start(case, regime, seed=seed, timeout=timeout, runner=runner, **options).result()
    finally:
        runner.close()


class Started:
    """A run begun: ``result()`` gives its RunResult (raising what the run raised); ``abandon()`` gives it up.

    A run on the warm pool is on its ranks from :func:`start` on, so the parent can work meanwhile (the
    reference in this process); one abandoned there closes its pool, whose reply must answer nothing later.
    A run that could not start raises its error from ``result()``, where a run's errors are read."""

    def __init__(self, finish: Callable[[], RunResult], abandon: Callable[[], None] = lambda: None) -> None:
        self._finish, self._abandon, self.done = finish, abandon, False

    def result(self) -> RunResult:
        self.done = True
        return self._finish()

    def abandon(self) -> None:
        if not self.done:
            self.done = True
            self._abandon()

    @classmethod
    def failed(cls, error: Exception) -> Started:
        def reraise() -> RunResult:
            raise error
        return cls(reraise)


def start(case: Case | str, regime: Regime | str, *, seed: int = DEFAULT_SEED, timeout: float = DEFAULT_TIMEOUT,
          runner: IsolatedRunner | None = None, against: Expected | None = None, **options) -> Started:
    """Begin a run: its arguments checked once (:class:`RunRequest`), then :func:`start_request`."""
    expect_timeout(timeout)
    request = RunRequest.of(case, regime, seed=seed, **options)
    return start_request(request, timeout=timeout, runner=runner, against=against)


def start_request(request: RunRequest, *, timeout: float = DEFAULT_TIMEOUT, runner: IsolatedRunner | None = None,
                  against: Expected | None = None) -> Started:
    """Begin the run ``request`` asks for: a warm-pool job is sent to its ranks now; a run in this process (or in a
    launcher's group, where every rank must run it together) happens when its result is asked for, in ``runner``'s
    forked child where one is given and the run can leave this process (isolation.py). ``against``: the reference
    the run is compared with as it trains (a forked child has none: its run comes back recorded whole)."""
    regime = request.regime
    reason = regime.unavailable(request.device) or regime.unavailable_in(request.precision, request.device)
    placed = regime.placement(request.device)
    if reason is None and placed is not None and not placed.on_gpus and "cpu" not in request.precision.devices:
        reason = f"precision {request.precision.name!r} trains on {' and '.join(request.precision.devices)} only" + (
            f", and {placed.note}" if placed.note else ", and these ranks train over gloo on the CPU")
    if reason is not None:
        raise Unavailable(reason)
    if regime.between:  # a resume: two segments, each in processes of its own
        return Started(lambda: train_resumed(request, timeout, _assembled))
    if not regime.distributed:
        if runner is not None:
            return Started(lambda: runner.train(request, timeout))
        return Started(lambda: run_request(request, against))
    job = TrainJob.of(request, importable_source(request.case),
                      None if against is None else shared_reference.payload(against))  # a file the ranks map
    backend = regime.placement(request.device).backend
    if launcher.active():
        return Started(lambda: _assembled(launcher.run_job(backend, regime.world_size, job)))
    in_flight = pool.submit_job(backend, regime.world_size, job, timeout)
    return Started(lambda: _assembled(in_flight()), in_flight.abandon)


def _assembled(replies: list[dict]) -> RunResult:
    """One RunResult of the ranks' replies: rank 0's, with the step losses and how far the ranks stood apart (measured
    on the ranks where they compared with the reference as they trained, and kept no tensor to send)."""
    results = [RunResult.from_plain(reply) for reply in replies]
    # Each rank returns its share of the step's loss (None: a step that returns none).
    losses = tuple(None if None in shares else sum(shares) for shares in zip(*(r.losses for r in results)))
    if results[0].measured is not None:
        return dataclasses.replace(results[0], losses=losses)
    spread, drift = _spread(results)
    return dataclasses.replace(results[0], losses=losses, rank_spread=spread, rank_drift=drift,
                               rank_grad_spread=_grad_spread(results),
                               traces=tuple(trace for r in results for trace in r.traces))


def _spread(results: list[RunResult]) -> tuple[float, str]:
    """How far the ranks' final weights ended apart (DDP keeps replicas identical, so 0), and where: the weight and the
    rank furthest from rank 0's."""
    first = results[0].weights
    apart = [(float((r.weights[n] - first[n]).abs().max()), n, rank) for rank, r in enumerate(results[1:], 1)
             for n in first if first[n].numel()]
    spread, name, rank = max(apart, default=(0.0, "", 0))
    return spread, drift_place(name, rank) if spread else ""


def _grad_spread(results: list[RunResult]) -> tuple[tuple[float, ...], ...]:
    """Per step, how far each rank's gradients were from rank 0's when its optimizer stepped: all-reduced
    gradients are the same on every rank, so a rank that differs was never synchronised with rank 0."""
    def apart(grads: dict, first: dict) -> float:
        return max((float((grads[n] - first[n]).abs().max()) for n in first), default=0.0)

    return tuple(tuple(apart(grads, step[0]) for grads in step) for step in zip(*(r.grads for r in results)))
