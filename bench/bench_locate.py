"""What saying where a run parts costs at real model sizes: a failed check with its location, beside the same check
with the localizer left out, and beside torch alone training the case once, each in a fresh process.

For each size (the GELU MLP of 25M parameters and the GPT-2-shaped transformer of 124M, float32, AdamW), the check
``ec.check(case, ["zero_grad_inside:chunks=4"])``: a bug that gradient accumulation meets (the gradients zeroed inside
the micro-batch loop), located at step 0, the gradient phase, after every record of the step has been compared. The
localizer's own seconds are timed inside the located check; its replays stop after the step they trace.

    python bench/bench_locate.py [--sizes 25m 124m]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = {"25m": "scale_mlp_25m", "124m": "scale_gpt2_124m"}
REGIME = "zero_grad_inside:chunks=4"
SIDES = ("located", "unlocated", "torch")


def measure(size: str, side: str) -> dict:
    """One side in this process (a fresh one): seconds, the localizer's seconds, peak RSS, the location found."""
    import importlib

    import equivcheck as ec
    from scale_cases import train_alone
    from timing import peak_resident_kib

    case = ec.get_case(CASES[size])
    checking = importlib.import_module("equivcheck.check")
    spent = []
    if side == "unlocated":
        checking._located = lambda outcome, *rest: outcome
    elif side == "located":
        located = checking._located

        def timed(*args):
            started = time.perf_counter()
            try:
                return located(*args)
            finally:
                spent.append(time.perf_counter() - started)
        checking._located = timed
    started = time.perf_counter()
    where = ""
    if side == "torch":
        train_alone(case)
    else:
        outcome = ec.check(case, [REGIME]).outcomes[0]
        assert outcome.verdict is ec.Verdict.MISMATCH, outcome.describe()
        where = outcome.location.describe() if outcome.location else ""
    return {"seconds": time.perf_counter() - started, "localizer": sum(spent), "rss_kib": peak_resident_kib(),
            "where": where}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.size, args.side)))
        return
    here = Path(__file__).resolve().parent
    rows = [("size", "torch alone, 1 training", "check unlocated", "check located", "localizer", "peak RSS unlocated",
             "peak RSS located")]
    for size in args.sizes:
        got = {side: json.loads(subprocess.run([sys.executable, __file__, "--side", side, "--size", size],
                                               cwd=here, check=True, capture_output=True, text=True).stdout
                                .strip().splitlines()[-1]) for side in SIDES}
        located, unlocated, alone = got["located"], got["unlocated"], got["torch"]
        rows.append((size, f"{alone['seconds']:.1f} s", f"{unlocated['seconds']:.1f} s", f"{located['seconds']:.1f} s",
                     f"{located['localizer']:.1f} s ({located['localizer'] / alone['seconds']:.2f} trainings)",
                     f"{unlocated['rss_kib'] / 2**20:.2f} GiB", f"{located['rss_kib'] / 2**20:.2f} GiB"))
        print(f"{size}: {located['where']}", file=sys.stderr)
    from timing import markdown_table

    print(markdown_table(rows))


if __name__ == "__main__":
    main()
