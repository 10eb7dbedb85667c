"""A resumed run (:class:`equivcheck.regimes.resume.Resume`): its segments (two, or more for a run restarted more
than once), each on ranks started for it alone that end with it (a one-rank group for a regime of one process), each
checkpoint in a folder between two of them; one RunResult of them all, as an uninterrupted run would have produced
it."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile

from ..errors import Unavailable
from ..regimes import Regime
from ..registry import importable_source
from ..result import RunResult
from .ranks import launcher, pool
from .ranks.jobs import TrainJob
from .request import Checkpointed, Restart, RunRequest

def train_resumed(request: RunRequest, timeout: float, assembled) -> RunResult:
    """Every segment of the resume ``request`` asks for, in turn, and the run they make together; ``assembled`` turns
    the ranks' replies into one result (dispatch.py)."""
    if launcher.active():
        raise Unavailable("a resume starts fresh processes for each segment, which a launcher's fixed group cannot: "
                          "run it without torchrun")
    resume = request.regime
    links = resume.links
    folders = [tempfile.mkdtemp(prefix=f"{pool.CHECKPOINT_PREFIX}{os.getpid()}-") for _ in links]  # a dead maker's:
    try:  # pool.py removes them
        saved = [Checkpointed(folder, link.saves, link.save, link.load) for folder, link in zip(folders, links)]
        bounds = [0, *(link.at for link in links), None]
        results = [_segment(request, regime, Restart(bounds[i], bounds[i + 1], saved[i - 1] if i else None,
                                                     saved[i] if i < len(saved) else None,
                                                     whole_source=not regime.steps_observable), timeout, assembled)
                   for i, regime in enumerate(resume.segments)]
        return functools.reduce(lambda first, rest: joined(first, rest, str(resume)), results)
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def _segment(request: RunRequest, regime: Regime, restart: Restart, timeout: float, assembled) -> RunResult:
    placed = request.regime.segment_placement(regime, request.device)
    segment = dataclasses.replace(request, regime=regime, restart=restart, trace_steps=_traced_in(request, restart))
    job = TrainJob.of(segment, importable_source(request.case))
    return assembled(pool.run_in_fresh_ranks(placed.backend, regime.world_size, job, timeout))


def _traced_in(request: RunRequest, restart: Restart) -> tuple[int, ...]:
    """The steps of this segment's own count a replay traces: the run's ``trace_steps`` this segment trains (its steps
    counted from its first batch; its traces are numbered as the whole run's)."""
    return tuple(step - restart.start for step in request.trace_steps
                 if step >= restart.start and (restart.stop is None or step < restart.stop))


def joined(first: RunResult, rest: RunResult, regime: str) -> RunResult:
    """The run two consecutive segments make: the steps of the first then the rest's, the final state the rest's."""
    def both(field: str):
        a, b = getattr(first, field), getattr(rest, field)
        return None if a is None or b is None else (*a, *b)

    peaks = [r.peak_activation_bytes for r in (first, rest) if r.peak_activation_bytes is not None]
    return dataclasses.replace(
        rest, regime=regime, losses=first.losses + rest.losses, grads=first.grads + rest.grads,
        seconds=first.seconds + rest.seconds, syncs=both("syncs"), sync_bytes=both("sync_bytes"),
        collectives=both("collectives"), rank_grad_spread=both("rank_grad_spread"),
        steps_per_batch=both("steps_per_batch"), batch_samples=first.batch_samples + rest.batch_samples,
        grad_norms=first.grad_norms + rest.grad_norms, peak_activation_bytes=max(peaks, default=None),
        loss_dtypes=tuple(sorted({*first.loss_dtypes, *rest.loss_dtypes})), traces=first.traces + rest.traces)
