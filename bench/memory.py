"""Memory benchmark: what each regime keeps alive, what it costs in time, what measuring costs.

For every case (the built-in ones and ``wide_mlp``, big enough for the process to feel it) and each
of its regimes, measured side by side in one run:

- peak activation bytes (equivcheck's figure) and its ratio to full_batch;
- wall time of ``equivcheck.run`` (median of --repeats) and its ratio to full_batch;
- the whole-process peak (VmHWM) of a fresh subprocess that runs only that regime, and its
  difference from full_batch's subprocess: working memory, gradients and temporaries included.
  Not ``ru_maxrss``: on Linux a child's counts the parent's size at the fork.

Then the cost of the measurement itself: ``run`` with and without it, alternated, median of
--overhead-repeats each. Torch runs on one thread so that timings on a shared machine mean something.

    python bench/memory.py [--case NAME ...] [--repeats N] [--overhead-repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.judge.memory import format_bytes
from timing import alternated_times, median_seconds, peak_resident_kib

REGIMES = ("full_batch", "sample_by_sample", "accumulate:chunks=4", "retained_graph:chunks=4",
           "summed_loss:chunks=4", "detached_partial:chunks=4")
OVERHEAD_REGIMES = ("full_batch", "sample_by_sample", "accumulate:chunks=4")


def wide_model():
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 10))


wide_mlp = ec.register_case(ec.Case(
    name="wide_mlp",
    model=wide_model,
    data=lambda: (torch.randn(1024, 64), torch.randint(0, 10, (1024,))),
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=1024,
    split=lambda m: (m[:4], m[4]),
    description="bench only: 1024 samples through two 1024-wide tanh layers, ~16 MiB of activations",
))


def regimes_of(case: ec.Case) -> list[str]:
    chosen = [r for r in REGIMES if case.split is not None or not r.startswith("detached_partial")]
    return [r for r in chosen if ":chunks=" not in r or int(r.rsplit("=", 1)[1]) <= case.batch_size]


def process_peak_kib(case: str, spec: str) -> int:
    """Peak resident memory (KiB) of a fresh interpreter that runs only this regime."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case, spec],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def child(case: str, spec: str) -> None:
    torch.set_num_threads(1)
    ec.run(case, spec, measure_memory=False)
    print(peak_resident_kib())


def case_table(name: str, repeats: int) -> str:
    case = ec.get_case(name)
    rows = []
    for spec in regimes_of(case):
        result = ec.run(case, spec)
        rows.append((spec, result.peak_activation_bytes, median_seconds(lambda: ec.run(name, spec), repeats), process_peak_kib(name, spec)))
    _, ref_bytes, ref_seconds, ref_rss = rows[0]
    header = ("regime", "peak activation", "ratio", "wall ms", "wall ratio", "process peak", "vs full_batch")
    table = [header] + [
        (spec, format_bytes(peak), f"{peak / ref_bytes:.3f}" if ref_bytes else "-", f"{seconds * 1e3:.1f}", f"{seconds / ref_seconds:.2f}",
         f"{rss / 1024:.1f} MiB", f"{(rss - ref_rss):+d} KiB")
        for spec, peak, seconds, rss in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(text.rjust(w) if i else text.ljust(w) for i, (text, w) in enumerate(zip(row, widths)))
             for row in table]
    return f"{name} ({case.steps} x {case.batch_size}, {ec.run(case, 'full_batch').memory_method})\n" + "\n".join(lines)


def overhead(repeats: int) -> str:
    lines = ["cost of measuring (mlp; alternated runs, median and fastest):"]
    for spec in OVERHEAD_REGIMES:
        with_meter, without = alternated_times(lambda: ec.run("mlp", spec, measure_memory=True),
                                               lambda: ec.run("mlp", spec, measure_memory=False), repeats=repeats)
        for label, pick in (("median", statistics.median), ("fastest", min)):
            on, off = pick(with_meter), pick(without)
            lines.append(f"  {spec:<20} {label:<7}  with {on * 1e3:.3f} ms  without {off * 1e3:.3f} ms  "
                         f"cost {(on - off) * 1e6:+.0f} us ({on / off - 1:+.1%})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="a case to measure (repeatable; default: all)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per regime (median)")
    parser.add_argument("--overhead-repeats", type=int, default=200, help="runs with and without measuring (median)")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; equivcheck memory benchmark\n")
    for name in args.case or list(ec.all_cases()):
        print(case_table(name, args.repeats) + "\n", flush=True)
    print(overhead(args.overhead_repeats))


if __name__ == "__main__":
    main()
