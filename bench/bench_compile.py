"""What a check of a compiled regime costs, side by side with torch alone's three compiled trainings.

Each side in a fresh process, ``--repeats`` times in a row (torch's caches, in memory and on disk, as a session of
checks finds them after the first): torch alone trains the case three times as a team writes it (two full-batch runs
and one accumulated over 4 micro-batches, the model compiled by inductor, the compile included in the time);
``ec.check(case, ["accumulate:chunks=4,compile=inductor"])`` trains its eager reference twice and the compiled
candidate once, each compiled run compiling afresh (dynamo's in-memory cache reset, so that the graphs it counts are
its own: equivcheck.regimes.compiled) from inductor's on-disk cache. Quiet, then beside a busy neighbour on every
core. Target: at most 1.5x.

    python bench/bench_compile.py [--cases scale_mlp_1m ...] [--repeats 3] [--quiet-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import equivcheck as ec
from bench_threads import busy_neighbour
from scale_cases import CASES, train_alone
from timing import markdown_table

CHUNKS = 4
REGIME = f"accumulate:chunks={CHUNKS},compile=inductor"
TARGET = 1.5


def alone(case: str) -> None:
    for chunks in (1, 1, CHUNKS):
        train_alone(CASES[case], chunks=chunks, compile="inductor")


def checked(case: str) -> None:
    report = ec.check(case, [REGIME], measure_memory=False)
    if not report.ok:
        raise SystemExit("the check did not pass:\n" + "\n".join(o.describe() for o in report.outcomes))


def side(name: str, case: str, repeats: int) -> list[float]:
    """This (fresh) process's times of ``repeats`` runs of one side in a row."""
    work = {"alone": alone, "check": checked}[name]
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work(case)
        seconds.append(time.perf_counter() - started)
    return seconds


def in_fresh_process(name: str, case: str, repeats: int) -> list[float]:
    done = subprocess.run([sys.executable, __file__, "--side", name, "--cases", case, "--repeats", str(repeats)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name} on {case} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["scale_mlp_1m", "scale_mlp_25m"], choices=sorted(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-only", action="store_true", help="leave out the busy neighbour")
    parser.add_argument("--side", choices=("alone", "check"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.cases[0], args.repeats)))
        return
    rows = [("case", "neighbour", "torch alone (first, median of the rest)", "check (first, median of the rest)",
             "first", "after")]
    for busy in (False,) if args.quiet_only else (False, True):
        with busy_neighbour(busy):
            for case in args.cases:
                times = {name: in_fresh_process(name, case, args.repeats) for name in ("alone", "check")}
                later = {name: statistics.median(t[1:] or t) for name, t in times.items()}
                rows.append((case, "busy" if busy else "quiet",
                             f"{times['alone'][0]:.1f} s, {later['alone']:.1f} s",
                             f"{times['check'][0]:.1f} s, {later['check']:.1f} s",
                             f"{times['check'][0] / times['alone'][0]:.2f}x",
                             f"{later['check'] / later['alone']:.2f}x"))
                print(markdown_table([rows[0], rows[-1]]), flush=True)
    print(markdown_table(rows))
    print(f"target: at most {TARGET}x")


if __name__ == "__main__":
    main()
