"""Wall times for the benchmarks (run as scripts from bench/): one action, or several alternated."""

from __future__ import annotations

import statistics
import time


def alternated_times(*actions, repeats: int) -> list[list[float]]:
    """Seconds of every run of each action, the actions run in turn so the shared machine's load falls
    on all alike."""
    times: list[list[float]] = [[] for _ in actions]
    for _ in range(repeats):
        for action, kept in zip(actions, times):
            started = time.perf_counter()
            action()
            kept.append(time.perf_counter() - started)
    return times


def alternated_seconds(*actions, repeats: int) -> list[float]:
    """The median seconds of each action, run in turn."""
    return [statistics.median(kept) for kept in alternated_times(*actions, repeats=repeats)]


def median_seconds(action, repeats: int) -> float:
    return alternated_seconds(action, repeats=repeats)[0]
