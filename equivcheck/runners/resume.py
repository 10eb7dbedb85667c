"""A resumed run (:class:`equivcheck.regimes.resume.Resume`): its two segments, each on ranks started for it alone
that end with it (a one-rank group for a regime of one process), the checkpoint in a folder between them; one
RunResult of the two, as an uninterrupted run would have produced it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

from ..errors import Unavailable
from ..regimes import Regime
from ..registry import importable_source
from ..result import RunResult
from .ranks import launcher, pool
from .ranks.jobs import TrainJob
from .request import Restart, RunRequest

def train_resumed(request: RunRequest, timeout: float, assembled) -> RunResult:
    """Both segments of the resume ``request`` asks for, in turn, and the run they make together; ``assembled`` turns
    the ranks' replies into one result (dispatch.py)."""
    if launcher.active():
        raise Unavailable("a resume starts fresh processes for each segment, which a launcher's fixed group cannot: "
                          "run it without torchrun")
    resume = request.regime
    folder = tempfile.mkdtemp(prefix=f"{pool.CHECKPOINT_PREFIX}{os.getpid()}-")  # a dead maker's: pool.py removes it
    try:
        first, rest = (_segment(request, regime, Restart(side, resume.at, folder, resume.saves, resume.save,
                                                         resume.load, whole_source=not regime.steps_observable),
                                timeout, assembled)
                       for side, regime in zip(("first", "rest"), resume.segments))
        return joined(first, rest, str(resume))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _segment(request: RunRequest, regime: Regime, restart: Restart, timeout: float, assembled) -> RunResult:
    placed = request.regime.segment_placement(regime, request.device)
    segment = dataclasses.replace(request, regime=regime, restart=restart)
    job = TrainJob.of(segment, importable_source(request.case))
    return assembled(pool.run_in_fresh_ranks(placed.backend, regime.world_size, job, timeout))


def joined(first: RunResult, rest: RunResult, regime: str) -> RunResult:
    """The run the two segments make: the steps of the first then the rest's, the final state the rest's."""
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
        loss_dtypes=tuple(sorted({*first.loss_dtypes, *rest.loss_dtypes})))
