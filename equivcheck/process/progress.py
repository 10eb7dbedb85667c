"""Signs of life from a run in another process, so that a timeout measures silence, not length.

A run's timeout is there to catch a hang (a collective the other ranks never joined, a deadlock), and a hang is a
run that stops making progress. A run that is merely long (many steps, a real model size, torch.compile's first
graphs on a loaded machine) keeps making it. So each process that trains for another (a rank, an isolating child)
writes the time of its last progress to a file its parent reads: an optimizer step taken, a graph compiled, an
evaluation's call of its model; and the parent gives up only after ``timeout`` seconds with none. The clock is
``time.monotonic()``, which every process on the machine shares. A check that trains in its own process (pytest's
``--equivcheck-timeout`` alarm) reads its own progress (:func:`here`), where waiting on a child or on ranks, each
bounded by its own, counts too.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator

_STAMP = struct.Struct("d")
_file: int | None = None  # the descriptor this process writes its progress to, where its parent reads it
_here: float | None = None  # this process's own last progress
_waiting = 0  # waits on other processes in progress, each bounded by their own progress


def report_to(descriptor: int) -> None:
    """Write this process's progress to ``descriptor`` from now on: each :func:`note`, and each graph torch.compile
    begins or ends (a first step's compiling can take minutes, and is progress)."""
    global _file
    first = _file is None
    _file = descriptor
    note()
    if first:
        try:  # training imports it anyway (creating an optimizer)
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without compile callbacks: there only steps are progress
            return
        callback_handler.register_start_callback(lambda args: note())
        callback_handler.register_end_callback(lambda args: note())


def note() -> None:
    """This process made progress now (a step, a compile)."""
    global _here
    _here = time.monotonic()
    if _file is not None:
        os.pwrite(_file, _STAMP.pack(_here), 0)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """This process waits on another (an isolating child, ranks) whose silence the wait itself times out: meanwhile
    it is making progress, as far as :func:`here` can tell."""
    global _waiting
    _waiting += 1
    try:
        yield
    finally:
        _waiting -= 1
        note()


def here() -> float | None:
    """When this process last made progress: now while it waits on others (:func:`waiting`), None if never."""
    return time.monotonic() if _waiting else _here


def last(descriptor: int) -> float | None:
    """When the process writing to ``descriptor`` last made progress (``time.monotonic()``), None if never."""
    data = os.pread(descriptor, _STAMP.size, 0)
    return _STAMP.unpack(data)[0] if len(data) == _STAMP.size else None


def deadline(started: float, timeout: float, stamps: list[float | None]) -> float:
    """When a job sent at ``started`` times out: ``timeout`` seconds after the least recent progress (``stamps``, from
    :func:`last`) of the processes still owing an answer, progress from before the job not counted. Each of them
    must keep making progress: a rank waiting on a hung peer makes none either."""
    return min(max(started, stamp or started) for stamp in stamps) + timeout
