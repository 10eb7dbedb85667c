"""What crash isolation and the precision preflight cost, measured side by side in one run, quiet and beside a
busy neighbour (a loop on every core).

Rows (medians; the runs alternated so the machine's load falls on both sides alike):
  one check in a process, forked child (isolate=True) / in this process    the price of one child per check
  the built-in matrix (`equivcheck run`), isolated / --no-isolate          target <= 1.2x
  the pitfall catalogue (`equivcheck catalogue`), isolated / --no-isolate  one child for every row
  one kernel probe of bf16-autocast (a forked child's forward and backward) paid once per process and precision

As users run it: no OMP_NUM_THREADS unless the caller set one (make bench unsets the Makefile's own).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import equivcheck as ec
from bench_threads import busy_neighbour
from equivcheck.process import kernels
from equivcheck.precision import resolve_precision
from timing import ROOT, alternated_seconds, compile_sources

BIN = Path(sys.executable).parent
CHECK = ("mlp", ["full_batch", "accumulate:chunks=4"])
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def command(*arguments: str) -> None:
    done = subprocess.run([str(BIN / "equivcheck"), *arguments], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"equivcheck {' '.join(arguments)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def measure(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    ec.check(*CHECK, isolate=True)  # warm: the lazy imports, once, before the clock
    isolated, in_process = alternated_seconds(lambda: ec.check(*CHECK, isolate=True), lambda: ec.check(*CHECK),
                                              repeats=args.repeats)
    rows = [("one check (mlp: full batch, 4 chunks)", isolated, in_process)]
    if not args.skip_commands:
        rows.append(("built-in matrix, equivcheck run", *alternated_seconds(
            lambda: command("run"), lambda: command("run", "--no-isolate"), repeats=args.process_repeats)))
        rows.append(("pitfall catalogue, equivcheck catalogue", *alternated_seconds(
            lambda: command("catalogue"), lambda: command("catalogue", "--no-isolate"), repeats=args.process_repeats)))
    bf16 = resolve_precision("bf16-autocast")
    probe, = alternated_seconds(lambda: kernels.probe(bf16, kernels.DEFAULT), repeats=args.repeats // 5)
    rows.append(("one bf16 kernel probe (once a process)", probe, float("nan")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40, help="repeats of the in-process check")
    parser.add_argument("--process-repeats", type=int, default=3, help="repeats of each command")
    parser.add_argument("--skip-commands", action="store_true", help="leave out the matrix and the catalogue")
    parser.add_argument("--quiet-only", action="store_true", help="leave out the busy neighbour")
    args = parser.parse_args()
    compile_sources()
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset (as users run it)')}")
    for busy in (False,) if args.quiet_only else (False, True):
        with busy_neighbour(busy):
            rows = measure(args)
        print(f"\n{'busy neighbour on every core' if busy else 'quiet'}")
        print(f"  {'measure':<42} {'isolated':>10} {'in process':>11} {'ratio':>7}")
        for name, isolated, in_process in rows:
            if in_process != in_process:  # nan: a cost with nothing beside it
                print(f"  {name:<42} {isolated * 1e3:>8.1f} ms")
            else:
                unit, scale = ("ms", 1e3) if in_process < 1 else ("s", 1)
                print(f"  {name:<42} {isolated * scale:>8.1f} {unit} {in_process * scale:>8.1f} {unit} "
                      f"{isolated / in_process:>6.2f}x")
    print("\ntarget: the built-in matrix isolated within 1.2x of --no-isolate")


if __name__ == "__main__":
    main()
