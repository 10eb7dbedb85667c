"""Mechanics: fail an in-process check that makes no progress for ``--equivcheck-timeout``, instead of hanging CI.

Uses SIGALRM, so it acts in the main thread on POSIX (where pytest and xdist workers run tests);
elsewhere it cannot interrupt the check and says so rather than pretending.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator


class CheckTimeout(BaseException):
    """A check ran longer than the timeout it was given. Raised wherever the check happens to be, so it is no
    ``Exception``, as ``KeyboardInterrupt`` is none: code that turns a run's errors into verdicts, or reads a
    model's size where it can, must not swallow it and let the check go on past its deadline."""


def can_interrupt() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: float | None, what: str) -> Iterator[None]:
    """Raise :class:`CheckTimeout` inside the block once ``seconds`` have passed with no progress (None: no limit):
    a long check that keeps stepping runs on, as a distributed job on the pool does."""
    if seconds is None:
        yield
        return
    if not can_interrupt():
        raise CheckTimeout(f"timeout={seconds:g} s was asked for {what}, but this platform or thread "
                           "cannot interrupt a check (SIGALRM in the main thread is needed)")

    from equivcheck.process import progress  # here, not at the top: loading the plugin imports no torch

    started = time.monotonic()

    def expire(signum, frame):
        left = progress.deadline(started, seconds, [progress.here()]) - time.monotonic()
        if left > 0:  # it made progress meanwhile (a step, a compile, a child or ranks still answering in time)
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        raise CheckTimeout(f"{what} made no progress for timeout={seconds:g} s (no step taken, nothing compiled); "
                           "if it is only slow, allow more: --equivcheck-timeout SECONDS or "
                           "@pytest.mark.equivcheck(timeout=...)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
