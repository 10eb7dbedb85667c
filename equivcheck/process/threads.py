"""How many intra-op threads a run trains with: one, unless the user chose a number.

A case is a few tiny tensors: torch's default of one thread per core makes its threads wait for each
other, and on a busy machine (a CI runner, ``pytest -n auto``) a check becomes tens of times slower.
The user chooses with ``threads=N`` on the call, with ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in the
environment, or with ``torch.set_num_threads(N)`` after importing equivcheck (any N other than the
count torch had then); the caller's setting is restored after each run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..errors import expect_int

ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
AT_IMPORT = torch.get_num_threads()  # what torch chose by itself, unless the user called it before importing us


def resolve(threads: int | None) -> int:
    """The intra-op thread count a run uses: ``threads`` if given, else the user's choice, else 1."""
    if threads is not None:
        return expect_int("threads", threads)
    current = torch.get_num_threads()
    chosen = any(os.environ.get(name) for name in ENVIRONMENT) or current != AT_IMPORT
    return current if chosen else 1


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
