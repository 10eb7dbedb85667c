"""What a check costs at real model sizes, side by side with torch alone training the same case.

For each size (a GELU MLP of about 1M, 25M and 100M parameters, float32, AdamW, 3 steps of 16 samples) and
each regime (``accumulate:chunks=4`` in process, ``ddp:world_size=2`` on ranks), each side in fresh processes:

- torch alone: the case's training as a team writes it (``scale_cases.train_alone``; under DDP, 2 gloo ranks),
  three times: the floor the figures are held to, a self-checked check's three trainings. Its time, and the
  peak RSS (VmHWM) of each process that trained, ranks included. In process, also the regime's own floor (two
  full-batch trainings and one accumulated over 4 micro-batches, the same work as the check's three runs), and
  that floor while the process holds as many touched bytes as the check's recording, each in a fresh process;
- ``ec.check(case, [regime])`` with its defaults, after a warm-up check of the 1M case (imports, the warm
  pool's ranks): its time and its peak RSS, of the checking process and of each rank.

Printed as ratios, check over torch alone. Then rows for the GPT-2-shaped transformers checked in one process, at
6.5M and 124M parameters (the larger one's RSS against a 16 GB runner), and for an LM shaped outside the project
(``nn.TransformerEncoderLayer``, a tied head) at 25M and 124M. One intra-op thread on both sides, as
equivcheck trains by default.

    python bench/bench_scale.py [--sizes [1m 25m 100m]] [--regimes accumulate:chunks=4 ddp:world_size=2] [--gpt [6m 124m]]
                                [--outside [25m 124m]] [--busy] [--repeats N] [--dtype float32|bf16-autocast]
                                [--optimizer adamw muon] [--no-floors]

``--optimizer adamw muon`` gives each transformer row twice, side by side: under AdamW, and under Muon for the blocks'
matrices with AdamW for the rest (``scale_cases.MuonWithAdamW``): a matrix optimizer's update reads each whole
matrix, so an anchored check compares it whole, not in blocks of rows.

``--dtype bf16-autocast`` checks every row under bf16 autocast (float32 weights), and torch alone trains its forward
and loss under the same autocast.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import equivcheck as ec
from bench_threads import busy_neighbour
from scale_cases import CASES, MLP_SIZES, OUTSIDE_SIZES, train_alone
from timing import markdown_table, peak_resident_kib

TRAININGS = 3  # a self-checked check trains the reference twice and the regime once
CHUNKS = 4
IN_PROCESS, DDP = f"accumulate:chunks={CHUNKS}", "ddp:world_size=2"
AUTOCAST = {"float32": None, "bf16-autocast": torch.bfloat16}  # the precision modes a row can be checked in
GPT_CASES = {"6m": "scale_gpt_6m", "124m": "scale_gpt2_124m"}
OPTIMIZERS = {"adamw": "", "muon": "_muon"}  # the transformers' optimizer: a case name's suffix (scale_cases.py)


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (its ranks, the warm pool's forker), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def rank_peaks_kib() -> list[int]:
    """The peaks of this process's descendants that trained: the pool's ranks (the forker trains nothing)."""
    peaks = []
    for pid in descendants(os.getpid()):
        try:
            peaks.append(peak_resident_kib(pid))
        except (OSError, RuntimeError):
            continue
    return sorted(peaks, reverse=True)


def check_child(case: str, regime: str, dtype: str) -> dict:
    """One timed check after a warm-up check of the smallest case: seconds, verdict, this process's peak and the ranks'."""
    ec.check("scale_mlp_1m", [regime], dtype=dtype)
    started = time.perf_counter()
    report = ec.check(case, [regime], dtype=dtype)
    seconds = time.perf_counter() - started
    verdicts = sorted({o.verdict.value for o in report.outcomes})
    peaks = rank_peaks_kib() if regime == DDP else []
    notes = [o.reason for o in report.outcomes if o.reason]
    return {"seconds": seconds, "peak_kib": peak_resident_kib(), "rank_peaks_kib": peaks[:2], "verdicts": verdicts,
            "notes": notes}


def _alone_rank(rank: int, world_size: int, case: str, dtype: str, port: int, replies) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    warm_up(rank, world_size, dtype)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(TRAININGS):
        train_alone(CASES[case], rank=rank, world_size=world_size, autocast=AUTOCAST[dtype])
    dist.barrier()
    replies.put((rank, time.perf_counter() - started, peak_resident_kib()))
    dist.destroy_process_group()


def warm_up(rank: int = 0, world_size: int = 1, dtype: str = "float32") -> None:
    """One training of the smallest case: torch's lazy imports and kernels, as the check's warm-up has them."""
    train_alone(CASES["scale_mlp_1m"], rank=rank, world_size=world_size, autocast=AUTOCAST[dtype])


# Torch alone in one process, each in its own fresh process after the same warm-up as the check's: the micro-batches
# of each training. "regime" is a check's own work (two full batch, one accumulated); "held" is that work while the
# process holds as many touched bytes as the check's recording (on a virtual machine new memory costs more the more
# the process holds: what holding the recording costs torch alone).
FLOORS = {"trainings": (1,) * TRAININGS, "regime": (1, 1, CHUNKS), "held": (1, 1, CHUNKS)}


def parameter_count(case: str) -> int:
    """The case's model's parameters, counted on the meta device: no memory, no initialisation."""
    with torch.device("meta"):
        return sum(p.numel() for p in CASES[case].model().parameters())


def recording_bytes(case: str) -> int:
    """What the check's reference recording holds: every step's gradients and the final weights (float32)."""
    return parameter_count(case) * (CASES[case].steps + 1) * 4


def floor_child(case: str, work: str, dtype: str) -> dict:
    """Torch alone in one process: ``FLOORS[work]``'s trainings, timed after a warm-up; the process's peak."""
    torch.set_num_threads(1)
    warm_up(dtype=dtype)
    held = torch.ones(recording_bytes(case) // 4) if work == "held" else None  # noqa: F841 (held while it trains)
    started = time.perf_counter()
    for chunks in FLOORS[work]:
        train_alone(CASES[case], chunks=chunks, autocast=AUTOCAST[dtype])
    return {"seconds": time.perf_counter() - started, "peak_kib": peak_resident_kib(), "rank_peaks_kib": []}


def ddp_child(case: str, world_size: int, dtype: str) -> dict:
    """Torch alone on ``world_size`` gloo ranks: three trainings, timed after a warm-up; each rank's peak."""
    replies = mp.get_context("spawn").SimpleQueue()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_alone_rank, args=(world_size, case, dtype, port, replies), nprocs=world_size)
    ranks = sorted(replies.get() for _ in range(world_size))
    return {"seconds": max(seconds for _, seconds, _ in ranks), "peak_kib": peak_resident_kib(),
            "rank_peaks_kib": sorted((peak for _, _, peak in ranks), reverse=True)}


def alone_figures(case: str, world_size: int, dtype: str, floors: bool = True) -> dict:
    """Torch alone's figures for a row: three trainings (on ranks under DDP); in process, also the regime's floor
    and that floor holding a recording, each in a fresh process, where ``floors``."""
    if world_size > 1:
        return in_fresh_process("ddp", case, str(world_size), dtype)
    if not floors:
        return in_fresh_process("floor", case, "trainings", dtype)
    trainings, regime, held = (in_fresh_process("floor", case, work, dtype) for work in FLOORS)
    return {**trainings, "regime_seconds": regime["seconds"], "held_seconds": held["seconds"]}


def in_fresh_process(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench child {args} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(kib: int) -> str:
    return f"{kib / 2**20:.2f} GB"


def parameters(case: str) -> str:
    return f"{parameter_count(case) / 1e6:.1f}M"


def combined(runs: list[dict]) -> dict:
    """Several fresh processes' figures as one: the median of each time, the greatest of each peak, every verdict."""
    merged = dict(runs[-1])
    for key in runs[0]:
        if key.endswith("seconds"):
            merged[key] = statistics.median(run[key] for run in runs)
        elif key.endswith("_kib"):
            merged[key] = (max(run[key] for run in runs) if key == "peak_kib" else
                           [max(peaks) for peaks in zip(*(run[key] for run in runs))])
    merged["verdicts"] = sorted({verdict for run in runs for verdict in run.get("verdicts", [])})
    return merged


def row(case: str, regime: str, notes: list[str], repeats: int, dtype: str, floors: bool = True) -> tuple[str, ...]:
    """One table row; with ``repeats``, each side in that many fresh processes, in turn."""
    world_size = 2 if regime == DDP else 1
    pairs = [(alone_figures(case, world_size, dtype, floors), in_fresh_process("check", case, regime, dtype))
             for _ in range(repeats)]
    alone, check = (combined([pair[side] for pair in pairs]) for side in (0, 1))
    notes += [f"{case} under {regime}: {note}" for note in check["notes"]]
    own_floor = "" if "regime_seconds" not in alone else (
        f" (regime's floor {alone['regime_seconds']:.1f} s: {check['seconds'] / alone['regime_seconds']:.2f}x; "
        f"that floor holding a recording's {recording_bytes(case) / 2**30:.1f} GB: {alone['held_seconds']:.1f} s, "
        f"{check['seconds'] / alone['held_seconds']:.2f}x)")
    ranks = ("-" if not check["rank_peaks_kib"] else
             f"{gib(max(check['rank_peaks_kib']))} / {gib(max(alone['rank_peaks_kib']))} = "
             f"{max(check['rank_peaks_kib']) / max(alone['rank_peaks_kib']):.2f}x")
    reference_peak = max(alone["rank_peaks_kib"]) if world_size > 1 else alone["peak_kib"]
    return (case, parameters(case), regime, "/".join(check["verdicts"]),
            f"{check['seconds']:.1f} / {alone['seconds']:.1f} s = {check['seconds'] / alone['seconds']:.2f}x{own_floor}",
            f"{gib(check['peak_kib'])} / {gib(reference_peak)} = {check['peak_kib'] / reference_peak:.2f}x", ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(MLP_SIZES), choices=list(MLP_SIZES),
                        help="the MLPs' sizes (none: no MLP row)")
    parser.add_argument("--regimes", nargs="+", default=[IN_PROCESS, DDP], choices=[IN_PROCESS, DDP])
    parser.add_argument("--gpt", nargs="*", default=list(GPT_CASES), choices=list(GPT_CASES),
                        help="the transformers' rows (none: no transformer row)")
    parser.add_argument("--outside", nargs="*", default=list(OUTSIDE_SIZES), choices=list(OUTSIDE_SIZES),
                        help="the rows of the LM built from torch's TransformerEncoderLayer (none: no such row)")
    parser.add_argument("--busy", action="store_true", help="beside a busy neighbour: a loop on every core")
    parser.add_argument("--repeats", type=int, default=1,
                        help="each side of a row in this many fresh processes, in turn: medians of the times")
    parser.add_argument("--dtype", default="float32", choices=list(AUTOCAST), help="the precision mode of every row")
    parser.add_argument("--optimizer", nargs="+", default=["adamw"], choices=list(OPTIMIZERS),
                        help="the transformers' optimizers: AdamW, and Muon with AdamW (a row each, side by side)")
    parser.add_argument("--no-floors", dest="floors", action="store_false",
                        help="torch alone's three trainings only, not the regime's floors (a slow row's hour halved)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, case, extra, dtype = args.child
        children = {"check": check_child, "floor": floor_child,
                    "ddp": lambda case, ranks, dtype: ddp_child(case, int(ranks), dtype)}
        print(json.dumps(children[kind](case, extra, dtype)))
        return
    beside = "; beside a loop on every core" if args.busy else ""
    print(f"torch {torch.__version__}, {args.dtype}, one intra-op thread a process; {os.cpu_count()} CPUs; load "
          f"{os.getloadavg()[0]:.1f}{beside}; medians of {args.repeats} fresh processes a side\n"
          f"check / torch alone: time (alone: {TRAININGS} trainings), peak RSS of the "
          "checking process (against one torch-alone process that trains; under DDP, its largest rank) and of the "
          "largest rank\n", flush=True)
    header = ("case", "parameters", "regime", "verdict", "time", "peak RSS, checking process", "peak RSS, ranks")
    rows, notes = [header], []
    transformers = [GPT_CASES[size] + OPTIMIZERS[optimizer] for size in args.gpt for optimizer in args.optimizer]
    cases = [f"scale_mlp_{size}" for size in args.sizes] + transformers + [
        f"outside_lm_{size}" for size in args.outside]
    with busy_neighbour(args.busy):
        for case in cases:
            for regime in args.regimes if case.startswith("scale_mlp") else [IN_PROCESS]:
                rows.append(row(case, regime, notes, args.repeats, args.dtype, args.floors))
                print("  ".join(rows[-1]), flush=True)
    print("\n" + markdown_table(rows) + "".join(f"\n- {note}" for note in notes))


if __name__ == "__main__":
    main()
