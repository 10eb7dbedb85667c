"""Seed 000's matrix: gradient accumulation over the head only, on 2 DDP ranks (the ``seed000_ddp`` case).

Per regime: the verdict, the margin, the gradient all-reduces of each step, the peak activation memory
of one rank beside plain DDP's, then what equivcheck said of each regime that is not equivalent.
With ``--repeats N``: the median wall time of one run on the warm pool beside in-process runs, the
runs alternated so the shared machine's load falls on all alike.
"""

from __future__ import annotations

import argparse

import equivcheck as ec
from timing import alternated_seconds
from equivcheck.render.text import render_columns
from equivcheck.judge.memory import format_bytes

CASE = "seed000_ddp"
PLAIN = "ddp:world_size=2"
TIMED = ("accumulate:chunks=6", "detached_partial:chunks=6", PLAIN, "ddp_detached_partial:world_size=2,chunks=3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=0, help="time each of %s this many times" % (TIMED,))
    args = parser.parse_args()
    report = ec.check(CASE)
    plain = report.outcome(CASE, PLAIN).result.peak_activation_bytes
    table = [["regime", "verdict", "margin", "all-reduces per step", "peak activation (rank 0)", "vs plain DDP"]]
    said = []
    for o in report.outcomes:
        result, c = o.result, o.comparison
        peak = result.peak_activation_bytes if result else None
        table.append([
            o.regime, o.verdict.value, "-" if c is None else f"{c.margin:.1e}",
            "-" if result is None or result.syncs is None else " ".join(map(str, result.syncs)),
            "-" if peak is None else format_bytes(peak),
            "-" if peak is None or result.syncs is None else f"{peak / plain:.2f}x",
        ])
        if c is not None and not c.ok:
            said.append(f"{o.regime}:\n  " + "\n  ".join(filter(None, [c.hint, *c.problems])))
        elif o.reason:
            said.append(f"{o.regime}: {o.reason}")
    print(render_columns(table))
    print()
    print("\n".join(said))
    if args.repeats:
        times = alternated_seconds(*[lambda spec=spec: ec.run(CASE, spec) for spec in TIMED], repeats=args.repeats)
        print(f"\none run (2 steps), median of {args.repeats}, alternated:")
        for spec, seconds in zip(TIMED, times):
            print(f"  {spec:<44} {seconds * 1e3:6.1f} ms  {seconds / times[0]:5.2f}x {TIMED[0]}")


if __name__ == "__main__":
    main()
