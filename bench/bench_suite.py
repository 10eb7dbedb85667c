"""The test suite's own time: serial against pytest-xdist workers, side by side in one run.

Runs the whole suite on the editable install (`python -m pytest -q -p no:cacheprovider -n N`) for each worker
count given, in turn, and prints each wall time, the passed and skipped counts pytest reported, and the ratio
to the first count; with no OMP_NUM_THREADS in the environment unless the caller set one. Every run must pass:
a red suite has no time worth printing.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_suite.py            # -n 0, then -n 2
    .venv/bin/python bench/bench_suite.py --workers 0 2 4 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from timing import ROOT

TARGET_SECONDS = 60.0  # the target for the suite's test time on a 2-core machine


def run_suite(workers: int) -> tuple[float, str]:
    started = time.perf_counter()
    spread = ["-n", str(workers)] + (["--dist", "loadfile"] if workers else [])  # as make test spreads the files
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *spread],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0:
        sys.exit(f"the suite failed with -n {workers} (exit {done.returncode}): {summary}\n{done.stdout[-4000:]}")
    counts = ", ".join(re.findall(r"\d+ (?:passed|skipped)", summary))
    return seconds, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="worker counts, the first the base")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each count, alternated; medians shown")
    args = parser.parse_args()
    times: dict[int, list[float]] = {n: [] for n in args.workers}
    counts: dict[int, str] = {}
    for _ in range(args.repeats):
        for workers in args.workers:
            seconds, counts[workers] = run_suite(workers)
            times[workers].append(seconds)
    base = statistics.median(times[args.workers[0]])
    print(f"the suite, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"median of {args.repeats} run(s) each, alternated")
    for workers in args.workers:
        seconds = statistics.median(times[workers])
        verdict = "met" if seconds <= TARGET_SECONDS else "not met"
        print(f"  pytest -n {workers:<3} {seconds:7.1f} s   {base / seconds:.2f}x as fast as -n {args.workers[0]}   "
              f"{counts[workers]}   target <= {TARGET_SECONDS:.0f} s: {verdict}")


if __name__ == "__main__":
    main()
