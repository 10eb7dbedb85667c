"""The parallel regimes side by side on one case: per-rank memory, gradient syncs per step, and the
warm-pool time of one run next to in-process accumulate (medians, run in turn).

    OMP_NUM_THREADS=1 .venv/bin/python bench/parallel.py [--case block_stack] [--repeats 10] [--pipeline]

--pipeline: the pipeline regimes instead (stages exchange activations: no gradient sync to count), next to
in-process accumulate:chunks=4, the same four micro-batches.
"""

from __future__ import annotations

import argparse

import equivcheck as ec
from timing import alternated_seconds, markdown_table

SPECS = ("ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=3", "ddp:world_size=2,bucket_cap_mb=0.0001",
         "ddp:world_size=2,static_graph=1", "ddp:world_size=2,gradient_as_bucket_view=1", "zero:world_size=2",
         "fsdp:world_size=2", "fsdp_no_sync:world_size=2,chunks=3",
         "fsdp_no_sync:world_size=2,chunks=3,reshard_after_forward=0",
         "fsdp_sync_every_micro_batch:world_size=2,chunks=3", "ddp_hook:world_size=2,hook=fp16",
         "ddp_hook:world_size=2,hook=bf16", "ddp_join:world_size=2,chunks=3",
         "ddp_uneven_micro_batches:world_size=2,chunks=3")
PIPELINE_SPECS = ("pipeline:stages=2,microbatches=4", "pipeline:stages=2,microbatches=4,schedule=1f1b",
                  "pipeline:stages=2,microbatches=4,schedule=interleaved", "pipeline:stages=3,microbatches=6")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="block_stack")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pipeline", action="store_true", help="the pipeline regimes, next to accumulate:chunks=4")
    args = parser.parse_args()
    local = "accumulate:chunks=4" if args.pipeline else "accumulate:chunks=3"
    rows = [("regime", "params B/rank", "grads B/rank", "optim B/rank", "syncs/step", "sync B/step", "run ms",
             f"{local} ms")]
    for spec in PIPELINE_SPECS if args.pipeline else SPECS:
        result = ec.run(args.case, spec)  # starts the pool on the first
        parallel, accumulate = alternated_seconds(lambda: ec.run(args.case, spec), lambda: ec.run(args.case, local),
                                                  repeats=args.repeats)
        syncs = ("-", "-") if result.syncs is None else (str(result.syncs[0]), str(result.sync_bytes[0]))
        rows.append((spec, *map(str, result.state_bytes), *syncs,
                     f"{parallel * 1000:.0f}", f"{accumulate * 1000:.0f}"))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
