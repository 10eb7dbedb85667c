"""Threads: what a check costs as users run it, with and without OMP_NUM_THREADS, quiet and beside a busy neighbour.

Each configuration runs in a fresh process (the thread count is fixed when torch starts), measured side by
side in one run. Rows, per neighbour (quiet / every core busy with another process's loop):
  no thread setting in the environment (equivcheck's default: one intra-op thread per run)
  OMP_NUM_THREADS=1 (what the Makefile exports)
  threads = every core (torch's own default, what every run used before the one-thread rule)
Targets: the default within 1.1x of OMP_NUM_THREADS=1, for one check and for the built-in matrix (in-process
regimes; the DDP ranks always train with the parent's count).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

PROBE = r"""
import json, statistics, sys, time
import equivcheck as ec
threads = None if sys.argv[1] == "default" else int(sys.argv[1])
repeats = int(sys.argv[2])
ec.check("mlp", ["full_batch", "accumulate:chunks=4"], threads=threads)  # warm up
times = []
for _ in range(repeats):
    started = time.perf_counter()
    ec.check("mlp", ["full_batch", "accumulate:chunks=4"], threads=threads)
    times.append(time.perf_counter() - started)
started = time.perf_counter()
local = [c for c in ec.all_cases().values() if c.name in ec.builtin_cases()]
for case in local:
    specs = [s for s in ec.regimes_for(case) if not ec.parse_regime(s).distributed]
    ec.check(case, specs, threads=threads)
matrix = time.perf_counter() - started
print(json.dumps({"check": statistics.median(times), "matrix": matrix}))
"""

CONFIGURATIONS = [  # (label, environment change, threads argument)
    ("no thread setting (default: 1 thread)", {"OMP_NUM_THREADS": None}, "default"),
    ("OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}, "default"),
    (f"threads={os.cpu_count()} (torch's default)", {"OMP_NUM_THREADS": None}, str(os.cpu_count())),
]


def probe(environment: dict[str, str | None], threads: str, repeats: int) -> dict[str, float]:
    env = {k: v for k, v in (os.environ | environment).items() if v is not None}
    done = subprocess.run([sys.executable, "-c", PROBE, threads, str(repeats)], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def busy_neighbour(busy: bool) -> Iterator[None]:
    """Another process's loop on every core, as on a shared CI runner or beside ``pytest -n auto``."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() if busy else 0)]
    try:
        time.sleep(0.5 if busy else 0)
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="checks timed per configuration")
    parser.add_argument("--rounds", type=int, default=4,
                        help="each configuration measured this many times, in turn (2 let one busy row swing to 2x)")
    args = parser.parse_args()
    for busy in (False, True):
        results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in CONFIGURATIONS}
        with busy_neighbour(busy):
            for _ in range(args.rounds):
                for label, environment, threads in CONFIGURATIONS:
                    results[label].append(probe(environment, threads, args.repeats))
        medians = {label: {k: statistics.median(r[k] for r in runs) for k in ("check", "matrix")}
                   for label, runs in results.items()}
        one = medians["OMP_NUM_THREADS=1"]
        print(f"{'busy neighbour on every core' if busy else 'quiet'} (medians of {args.rounds} processes, "
              f"{args.repeats} checks each; matrix: every built-in case's in-process regimes)")
        for label, m in medians.items():
            print(f"  {label:<40} check {m['check'] * 1e3:7.1f} ms ({m['check'] / one['check']:5.2f}x)   "
                  f"matrix {m['matrix']:6.2f} s ({m['matrix'] / one['matrix']:5.2f}x)")
    print("targets: the default within 1.1x of OMP_NUM_THREADS=1, quiet and busy")


if __name__ == "__main__":
    main()
