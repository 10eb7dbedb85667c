"""Distributed checks: what a warm pool of worker ranks buys, measured side by side in one run.

Prints medians over repeats and the ratios the project targets:
  warm-pool DDP run / in-process accumulate run on the same case   (target <= 3x)
  ec.check with the DDP regime / ec.check with the accumulate one  (target <= 2x; the DDP job trains on its
                                                                     ranks while the reference runs here)
  a process's first pool start / a bare process importing torch    (its forker imports torch and torch._dynamo,
                                                                     which each rank imported before)
  a pool start once the forker runs / a bare process importing torch  (what forking the ranks saves)
  fresh process group per run / warm-pool run                       (what the pool saves)
  the same work with torch alone (plain_ddp.py, no equivcheck): DDP on gloo ranks / accumulation in one process
                                                                    (DDP's own ratio here: the floor under the first)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import equivcheck as ec
from timing import alternated_seconds, compile_sources, median_seconds
from equivcheck.runners.ranks.forker import shutdown_forker
from equivcheck.runners.ranks.pool import WorkerPool, pool_for, shutdown_pools


def fresh_group_run(case: str, spec: str) -> None:
    shutdown_pools()
    ec.run(case, spec)
    shutdown_pools()


def first_pool(world_size: int) -> None:
    """A process's first pool: its forker starts and imports torch and torch._dynamo, then forks the ranks."""
    shutdown_pools()
    shutdown_forker()
    WorkerPool("gloo", world_size).close()


def plain_torch(args: argparse.Namespace) -> dict | None:
    """DDP and accumulation of the same case with torch alone (plain_ddp.py), in a fresh process; None, said
    why, for a case its plain loops cannot train (the figures above are kept)."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("plain_ddp.py")), "--case", args.case,
                           "--world-size", str(args.world_size), "--repeats", str(args.repeats)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"no torch-alone rows: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        return None
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="mlp")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="repeats of the millisecond measurements")
    parser.add_argument("--start-repeats", type=int, default=3, help="repeats of the second-long measurements")
    parser.add_argument("--regime", help="the distributed spec timed (default: ddp:world_size=WORLD_SIZE)")
    args = parser.parse_args()
    ddp = args.regime or f"ddp:world_size={args.world_size}"
    local = f"accumulate:chunks={args.world_size}"
    compile_sources()  # the forker imports equivcheck as an installed copy would

    pool_for("gloo", args.world_size)  # warm up: pool started, case modules imported on every rank
    ec.run(args.case, ddp)
    ec.run(args.case, local)
    warm, in_process = alternated_seconds(lambda: ec.run(args.case, ddp), lambda: ec.run(args.case, local),
                                          repeats=args.repeats)
    check_ddp, check_local = alternated_seconds(lambda: ec.check(args.case, [ddp]), lambda: ec.check(args.case, [local]),
                                                repeats=args.repeats)
    bare_import = median_seconds(
        lambda: subprocess.run([sys.executable, "-c", "import torch"], check=True), args.start_repeats)
    first_start = median_seconds(lambda: first_pool(args.world_size), args.start_repeats)
    pool_start = median_seconds(lambda: WorkerPool("gloo", args.world_size).close(), args.repeats)
    fresh = median_seconds(lambda: fresh_group_run(args.case, ddp), args.start_repeats)
    shutdown_pools()
    plain = plain_torch(args) if args.regime is None else None

    rows = [
        (f"{ddp} run on the warm pool", warm, f"{warm / in_process:.2f}x in-process {local} ({in_process * 1e3:.1f} ms)",
         "<= 3x"),
        (f"ec.check with {ddp}", check_ddp,
         f"{check_ddp / check_local:.2f}x ec.check with {local} ({check_local * 1e3:.1f} ms)", "<= 2x"),
        (f"a process's first pool ({args.world_size} gloo ranks)", first_start,
         f"{first_start / bare_import:.2f}x a bare 'import torch' process ({bare_import:.2f} s)", ""),
        ("a pool start, the forker running", pool_start,
         f"{pool_start / bare_import:.3f}x a bare 'import torch' process", ""),
        (f"{ddp} run on a fresh process group", fresh, f"{fresh / warm:.0f}x the warm-pool run", ""),
    ]
    if plain is not None:  # the floor: DDP's own cost against accumulation's, torch alone
        plain_ddp, plain_local = plain["ddp_ms"] / 1e3, plain["accumulate_ms"] / 1e3
        rows += [
            (f"  torch alone: DDP, {args.world_size} gloo ranks", plain_ddp,
             f"{plain_ddp / plain_local:.2f}x torch alone accumulating in {args.world_size} chunks "
             f"({plain_local * 1e3:.1f} ms): DDP's own ratio", ""),
            ("  the warm-pool run / torch alone's DDP job", warm, f"{warm / plain_ddp:.2f}x: equivcheck's share", ""),
        ]
    print(f"case {args.case}; medians of {args.repeats} (ms figures) and {args.start_repeats} (s figures) repeats")
    for what, seconds, ratio, target in rows:
        shown = f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
        print(f"  {what:<44} {shown:>10}   {ratio}  {('target ' + target) if target else ''}")


if __name__ == "__main__":
    main()
