"""Medians of wall time for the benchmarks (run as scripts from bench/): one action, or two alternated."""

from __future__ import annotations

import statistics
import time


def median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def paired_seconds(first, second, repeats: int) -> tuple[float, float]:
    """Medians of two actions run alternately, so the shared machine's load falls on both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for action, kept in zip((first, second), times):
            started = time.perf_counter()
            action()
            kept.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])
