"""Progress on long work (the matrix, the catalogue, an audit): one line on a terminal, rewritten in place.

Silent in a pipe, under pytest and in CI logs: a progress line there is noise, and the report says it all.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, what: str, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _interactive(self.stream)
        self.total, self.what, self.done = total, what, 0
        self.started = time.perf_counter()

    def step(self, current: str) -> None:
        """One more item is starting: ``current`` names it."""
        self.done += 1
        if self.enabled:
            line = f"{self.what} {self.done}/{self.total}  {current}  {time.perf_counter() - self.started:.1f} s"
            self.stream.write("\r\033[K" + line[:_columns() - 1])
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _interactive(stream: TextIO) -> bool:
    return stream.isatty() and "PYTEST_CURRENT_TEST" not in os.environ and not os.environ.get("CI")


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        return 80
