"""Wall times and memory peaks for the benchmarks (run as scripts from bench/): one action, or several alternated; the
Markdown table the docs quote them in; and the byte-compiled sources that an installed package has."""

from __future__ import annotations

import compileall
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_sources() -> None:
    """Byte-compile equivcheck's sources, as pip does when it installs the wheel. The editable install is
    compiled again at every import where PYTHONDONTWRITEBYTECODE is set (0.1 s a process on this machine),
    which no installed copy pays; a benchmark of processes calls this first."""
    for package in ("equivcheck", "pytest_equivcheck", "cases"):
        compileall.compile_dir(str(ROOT / package), quiet=1)


def alternated_times(*actions, repeats: int, before=lambda: None) -> list[list[float]]:
    """Seconds of every run of each action, the actions run in turn so the shared machine's load falls
    on all alike; ``before`` runs untimed ahead of each (DDP ranks meet at a barrier, so all start together)."""
    times: list[list[float]] = [[] for _ in actions]
    for _ in range(repeats):
        for action, kept in zip(actions, times):
            before()
            started = time.perf_counter()
            action()
            kept.append(time.perf_counter() - started)
    return times


def alternated_seconds(*actions, repeats: int, before=lambda: None) -> list[float]:
    """The median seconds of each action, run in turn."""
    return [statistics.median(kept) for kept in alternated_times(*actions, repeats=repeats, before=before)]


def median_seconds(action, repeats: int, before=lambda: None) -> float:
    return alternated_seconds(action, repeats=repeats, before=before)[0]


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    """``rows`` (the first is the header) as a Markdown table, columns padded to line up."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def peak_resident_kib(pid: int | str = "self") -> int:
    """A process's own high-water mark (this one's by default): VmHWM belongs to its address space, made fresh by
    exec. Not ``ru_maxrss``: on Linux a child's counts the parent's size at the fork."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status: the process peak needs Linux")


@contextlib.contextmanager
def check_phases() -> Iterator[list[str]]:
    """Where a check's time goes, as it runs: each run it trains (its regime and precision, and whether it is compared
    as it trains) and each judgement past the comparison (which trains shadows or witnesses of its own), with its
    seconds, in the order they end. The device's queue is drained at each end, so a GPU's work is counted where it
    was asked for."""
    import importlib

    import torch

    from equivcheck.judge import rounding, witness

    check = importlib.import_module("equivcheck.check")  # the module: the package's ``check`` is the function
    phases: list[str] = []

    def synchronised() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(label: str, work):
        synchronised()
        started = time.perf_counter()
        try:
            return work()
        finally:
            synchronised()
            phases.append(f"{label} {time.perf_counter() - started:.2f} s")

    def start_request(request, **kwargs):
        began = original_start(request, **kwargs)
        label = f"{request.regime} {request.precision.name}" + (" as it trains" if kwargs.get("against") else "")
        finish = began._finish
        began._finish = lambda: timed(label, finish)
        return began

    original_start = check.start_request
    judgements = [(rounding, "settled_as_it_trained"), (rounding, "judge"), (witness, "by_the_reference"),
                  (witness, "end_weights_as_it_trained"), (witness, "judge"), (check, "_recorded")]
    originals = [(module, name, getattr(module, name)) for module, name in judgements]
    check.start_request = start_request
    for module, name, original in originals:
        setattr(module, name, lambda *a, _o=original, _n=name, **k: timed(_n, lambda: _o(*a, **k)))
    try:
        yield phases
    finally:
        check.start_request = original_start
        for module, name, original in originals:
            setattr(module, name, original)
