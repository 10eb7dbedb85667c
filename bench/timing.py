"""Wall times for the benchmarks (run as scripts from bench/): one action, or several alternated; and the
Markdown table the docs quote them in."""

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


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    """``rows`` (the first is the header) as a Markdown table, columns padded to line up."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)
