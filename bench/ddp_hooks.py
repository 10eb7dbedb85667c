"""DDP's compressing comm hooks on one case: the tolerance each is judged at, its margin there and at the
precision's own tolerance (float64's: where the compression shows), and the warm-pool time of one run next
to in-process accumulate (medians, run in turn).

    OMP_NUM_THREADS=1 .venv/bin/python bench/ddp_hooks.py [--case ddp_compressed_uneven_shards] [--dtype float64]
"""

from __future__ import annotations

import argparse

import equivcheck as ec
from timing import alternated_seconds, markdown_table

SPECS = ("ddp:world_size=2", "ddp_hook:world_size=2,hook=fp16", "ddp_hook:world_size=2,hook=bf16",
         "ddp_hook:world_size=2,hook=powersgd", "ddp_hook:world_size=2,hook=powersgd,start_iter=2",
         "ddp_hook_mean_loss:world_size=2,hook=fp16", "ddp_hook_mean_loss:world_size=2,hook=bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="ddp_compressed_uneven_shards")
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    local = "accumulate:chunks=2"
    report = ec.check(args.case, ["full_batch", *SPECS], dtype=args.dtype, measure_memory=False)
    reference = report.outcome(args.case, "full_batch").result
    rows = [("regime", "verdict", "rtol", "atol", "margin", f"margin at {args.dtype}'s", "run ms", f"{local} ms")]
    for spec in SPECS:
        outcome = report.outcome(args.case, spec)
        strict = ec.compare(reference, outcome.result)
        parallel, accumulate = alternated_seconds(lambda: ec.run(args.case, spec, dtype=args.dtype),
                                                  lambda: ec.run(args.case, local, dtype=args.dtype),
                                                  repeats=args.repeats)
        tol = outcome.comparison.tolerance
        rows.append((spec, outcome.verdict.value, f"{tol.rtol:.3g}", f"{tol.atol:.3g}",
                     f"{outcome.comparison.margin:.3g}", f"{strict.margin:.3g}", f"{parallel * 1000:.0f}",
                     f"{accumulate * 1000:.0f}"))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
