"""What a check costs on the GPU, side by side with torch alone training the same model on the same GPU.

The 124M GPT-2-shaped transformer (``scale_cases.gpu_gpt2_124m``: 4 steps of 8 x 256 tokens, AdamW), in float32 (TF32
off on both sides, as a check trains) and in bf16 autocast. Each side in a fresh process on the one GPU:

- torch alone: the check's three trainings as a team writes them (two full-batch runs, one accumulated over 4
  micro-batches), synchronised, their wall time and ``torch.cuda.max_memory_allocated``;
- ``ec.check(case, ["accumulate:chunks=4"], device="cuda", dtype=...)`` with its defaults: the same three trainings
  plus everything the check does, its wall time and peak GPU memory.

Each side runs ``--repeats`` times after a warm-up of its own (CUDA context, cuBLAS handles, torch's lazy imports);
the medians are printed as ratios, check over torch alone. Targets: 1.5x the time, 2x the peak GPU memory.

    python bench/bench_gpu.py [--dtypes float32 bf16-autocast] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import equivcheck as ec
from scale_cases import CASES, train_alone
from timing import check_phases, markdown_table

CASE = "gpu_gpt2_124m"
CHUNKS = 4
REGIME = f"accumulate:chunks={CHUNKS}"
AUTOCAST = {"float32": None, "bf16-autocast": torch.bfloat16}
TIME_TARGET, MEMORY_TARGET = 1.5, 2.0


def alone(dtype: str) -> None:
    """Torch alone: the check's three trainings, TF32 off as a check runs float32."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for chunks in (1, 1, CHUNKS):
        train_alone(CASES[CASE], chunks=chunks, device="cuda", autocast=AUTOCAST[dtype])


def checked(dtype: str) -> str:
    """The check, what it said and where its time went: its reason shows what it ran beyond the three trainings
    (float64 shadows, a rerun that disagreed), its phases each run's and each judgement's seconds."""
    with check_phases() as phases:
        report = ec.check(CASE, [REGIME], device="cuda", dtype=dtype)
    said = "\n".join(o.describe() for o in report.outcomes) + "\nphases: " + "; ".join(phases)
    if not report.ok:
        raise SystemExit(f"the check did not pass:\n{said}")
    return said


def measure_side(side: str, dtype: str, repeats: int) -> dict:
    """In this (fresh) process: a warm-up, then ``repeats`` timed runs, each from a reset peak."""
    work = {"alone": alone, "check": checked}[side]
    work(dtype)  # warm-up: the CUDA context, cuBLAS, lazy imports
    seconds, peaks = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        said = work(dtype)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        peaks.append(torch.cuda.max_memory_allocated())
    return {"seconds": statistics.median(seconds), "all_seconds": seconds, "peak_bytes": max(peaks), "said": said}


def side_in_fresh_process(side: str, dtype: str, repeats: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--side", side, "--dtypes", dtype, "--repeats", str(repeats)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{side} in {dtype} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=list(AUTOCAST), choices=list(AUTOCAST))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--side", choices=("alone", "check"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure_side(args.side, args.dtypes[0], args.repeats)))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device: torch.cuda.is_available() is False here")
    card = torch.cuda.get_device_name()
    print(f"{CASE} on {card}, torch {torch.__version__}: {REGIME} checked against torch alone's three trainings, "
          f"median of {args.repeats}")
    header = ("precision", "torch alone", "check", "time", "alone's peak", "check's peak", "memory")
    rows, figures, met = [], {}, True
    for dtype in args.dtypes:
        sides = {side: side_in_fresh_process(side, dtype, args.repeats) for side in ("alone", "check")}
        time_ratio = sides["check"]["seconds"] / sides["alone"]["seconds"]
        memory_ratio = sides["check"]["peak_bytes"] / sides["alone"]["peak_bytes"]
        met &= time_ratio <= TIME_TARGET and memory_ratio <= MEMORY_TARGET
        figures[dtype] = {**sides, "time_ratio": time_ratio, "memory_ratio": memory_ratio}
        rows.append([dtype, f"{sides['alone']['seconds']:.2f} s", f"{sides['check']['seconds']:.2f} s",
                     f"{time_ratio:.2f}x", f"{sides['alone']['peak_bytes'] / 2**30:.2f} GiB",
                     f"{sides['check']['peak_bytes'] / 2**30:.2f} GiB", f"{memory_ratio:.2f}x"])
        print(markdown_table([header, rows[-1]]), flush=True)  # each precision as it ends: a stopped bench keeps it
        print(f"the check said: {sides['check']['said']}", flush=True)
    print(markdown_table([header, *rows]))
    print(f"targets: time <= {TIME_TARGET}x, peak GPU memory <= {MEMORY_TARGET}x: {'met' if met else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"card": card, "torch": torch.__version__, "figures": figures}, file, indent=2)


if __name__ == "__main__":
    main()
