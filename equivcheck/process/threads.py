"""How many intra-op threads a run trains with: one, unless the user chose a number or the model is large.

A case is a few tiny tensors: torch's default of one thread per core makes its threads wait for each
other, and on a busy machine (a CI runner, ``pytest -n auto``) a check becomes tens of times slower.
The user chooses with ``threads=N`` on the call, with ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in the
environment, or with ``torch.set_num_threads(N)`` after importing equivcheck (any N other than the
count torch had then); the caller's setting is restored after each run.

A model of :data:`WIDE_FROM` parameters or more, where nobody chose and the machine has cores to spare (the tasks
runnable now), trains on torch's own count when it trains in the checking process, as the team's own training does. Measured
(bench/bench_compile.py, 2 cores): a check of a 25M-parameter MLP on one thread cost 2.2 times torch alone's three
trainings on both cores, 1.2 to 1.4 times on both; beside a busy neighbour on every core, both threads cost 7.3 times
(OpenMP's threads wait for cores the neighbour holds), one thread 0.24 times. The decision is the check's, taken once,
so its runs all train alike. A forked child and a rank stay on the count they are given (:func:`pin`): OpenMP's pool
does not survive a fork, and ranks share the cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..errors import expect_int

ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
AT_IMPORT = torch.get_num_threads()  # what torch chose by itself, unless the user called it before importing us
WIDE_FROM = 1_000_000  # parameters from which a run in this process trains on torch's own count
_pinned = False  # a forked child or a rank: the count it is given, whatever the model's size


def pin(threads: int) -> None:
    """This process (a forked child, a rank) trains every run, and copies every tensor, on ``threads``, set now.

    A process forked after its parent ran an OpenMP parallel region inherits a pool whose threads did not survive
    the fork: its first parallel region on more than one thread waits for them for ever (a tensor copy after the
    run as much as the run). Ranks share the cores."""
    global _pinned
    torch.set_num_threads(threads)
    _pinned = True


def wide(threads: int | None) -> int:
    """How many threads a check's large model may train on: 1 where the caller chose (its count holds), else torch's
    own count less the cores other processes hold now."""
    if chosen(threads):
        return 1
    return max(1, min(AT_IMPORT, int(AT_IMPORT - busy_cores())))


def busy_cores() -> float:
    """The cores other processes hold now: the runnable tasks ``/proc/loadavg`` counts at this instant, less this
    process's own (its OpenMP threads spin runnable a while after each parallel region); the 1-minute average lags a
    neighbour by a minute each way. Elsewhere that average, less this process; where neither is known, every core."""
    try:
        with open("/proc/loadavg") as status:
            runnable = int(status.read().split()[3].partition("/")[0])
        return max(0, runnable - max(1, _own_runnable_threads()))
    except (OSError, ValueError, IndexError):
        pass
    try:
        return max(0.0, os.getloadavg()[0] - 1)
    except OSError:
        return float(AT_IMPORT)


def chosen(threads: int | None) -> bool:
    """Whether the caller chose the thread count: ``threads=``, the environment, or ``torch.set_num_threads``."""
    return (threads is not None or any(os.environ.get(name) for name in ENVIRONMENT)
            or torch.get_num_threads() != AT_IMPORT)


def _own_runnable_threads() -> int:
    """This process's threads in the running state (``R`` in each ``/proc/self/task/*/stat``)."""
    running = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as stat:
                running += stat.read().rpartition(")")[2].split()[0] == "R"
        except OSError:  # a thread that ended meanwhile
            continue
    return running


def for_model(threads: int, wide_threads: int, parameters: int) -> int:
    """The count a run trains with once its model (of ``parameters``) is built: ``threads``, or ``wide_threads``
    (:func:`wide`) where the model is large and the run trains in this process, unpinned."""
    if not _pinned and threads == 1 and parameters >= WIDE_FROM:
        return wide_threads
    return threads


def resolve(threads: int | None) -> int:
    """The intra-op thread count a run uses: ``threads`` if given, else the user's choice, else 1."""
    if threads is not None:
        return expect_int("threads", threads)
    return torch.get_num_threads() if chosen(None) else 1


@contextlib.contextmanager
def using(threads: int) -> Iterator[None]:
    """Train with ``threads`` intra-op threads, and give the caller back its own count afterwards."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
