"""What a check costs, against the peer trainparity, measured side by side in one run (medians).

Rows and the targets of issue 7:
  in-process check (mlp: full_batch + accumulate:chunks=4, reference twice)   <= 10 ms, memory measured
  CLI process start to verdict, same accumulation check, vs trainparity        >= 4x faster
  per check inside one process, vs trainparity                                 >= 1000x faster
  verdicts on a correct and on a buggy accumulation                            the two tools agree
  the full built-in matrix (`equivcheck run`: every case x regime, DDP too)    < 60 s
  200 hypothesis examples, DDP regimes included (on the warm pool)              < 60 s
  `import equivcheck` / bare `import torch`                                    <= 1.1x
  `pytest --help` with the plugin / with it disabled (-p no:equivcheck)        <= 1.1x

The peer runs from its own virtual environment (bench/.peer-venv, made by `make bench-speed`) on
bench/peer_case.py: the mlp case's model, optimizer, dtype and 12-sample batch, with one optimizer update
per check where equivcheck trains 3 steps; a row without a target times equivcheck's same check on the case
trimmed to its first update, the peer's unit. The buggy accumulation is clip_grad_norm_ after every
micro-batch instead of once before the step, which both tools can express.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import equivcheck as ec
from timing import ROOT, alternated_seconds, compile_sources, median_seconds

BENCH = Path(__file__).resolve().parent
PEER_PYTHON = BENCH / ".peer-venv" / "bin" / "python"
BIN = Path(sys.executable).parent
CORRECT = ("mlp", ["full_batch", "accumulate:chunks=4"])
BUGGY = ("clip_per_micro_batch", ["clip_per_micro_batch:chunks=4,max_norm=0.1"])  # cases/clipping.py
# The floor of any process that trains: torch, and the torch._dynamo import every optimizer step triggers,
# leaving as the CLI does (exit handlers, then no interpreter teardown).
FLOOR = "import os, torch; torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1).step(); os._exit(0)"
# The CLI's own main() left through a normal exit: what skipping the interpreter's teardown saves.
WITH_TEARDOWN = "import sys; from equivcheck.cli import main; sys.exit(main(sys.argv[1:]))"
FAITHFUL = ["full_batch", "sample_by_sample", "accumulate", "retained_graph", "detached_partial"]
# As users run it: no OMP_NUM_THREADS on either side unless the caller set one (make bench-speed unsets the
# Makefile's own), so each tool trains with the threads it chooses itself.
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
THREADS = os.environ.get("OMP_NUM_THREADS", "unset (as users run it)")


def one_update_of(name: str) -> ec.Case:
    """The case trimmed to its first step: one optimizer update, the unit the peer checks."""
    case = ec.get_case(name)

    def first_batch():
        return tuple(tensor[:case.batch_size] for tensor in case.data())

    return dataclasses.replace(case, name=f"{name}_one_update", data=first_batch, steps=1)


def process(*command: str, expect_rc: int | None = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if expect_rc is not None and done.returncode != expect_rc:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def process_seconds(command: list[str], repeats: int, expect_rc: int | None = 0) -> float:
    return median_seconds(lambda: process(*command, expect_rc=expect_rc), repeats)


def alternated_processes(*commands: list[str], repeats: int) -> list[float]:
    return alternated_seconds(*(lambda command=command: process(*command) for command in commands), repeats=repeats)


def fuzz_seconds(examples: int) -> tuple[float, int, int]:
    """Wall time of ``examples`` hypothesis examples that must all be equivalent: a drawn case under a
    drawn faithful regime in-process, or (one draw in four) a built-in case under a drawn DDP regime on
    the warm pool. Returns the seconds, the examples that ran and how many of them were DDP."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from equivcheck.strategies import cases, regime_specs

    ran = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data(), distributed=st.integers(0, 3).map(lambda n: n == 0))
    def example(data, distributed):
        if distributed:
            case = data.draw(st.sampled_from(["mlp", "tokens", "gru_decoder"]))
            spec = data.draw(regime_specs(12, names=["ddp", "ddp_no_sync"], min_world_size=2, max_world_size=3))
        else:
            case = data.draw(cases())
            spec = data.draw(regime_specs(case.batch_size, names=FAITHFUL))
        (outcome,) = ec.check(case, [spec]).outcomes
        assert outcome.verdict is ec.Verdict.EQUIVALENT, outcome.describe()
        ran.append(distributed)

    started = time.perf_counter()
    example()
    return time.perf_counter() - started, len(ran), sum(ran)


def verdict_of(report: ec.Report) -> str:
    (outcome,) = [o for o in report.outcomes if o.regime != "full_batch"]
    return "equivalent" if outcome.verdict is ec.Verdict.EQUIVALENT else f"not equivalent ({outcome.verdict.value})"


def peer_verdict(outcome: str) -> str:
    return {"PASS": "equivalent", "FAIL": "not equivalent (FAIL)"}.get(outcome, f"no verdict ({outcome})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50, help="repeats of the in-process checks")
    parser.add_argument("--process-repeats", type=int, default=7, help="repeats of the sub-second processes")
    parser.add_argument("--peer-repeats", type=int, default=3, help="repeats of the peer's CLI-like process")
    parser.add_argument("--examples", type=int, default=200, help="hypothesis examples, one in four DDP")
    parser.add_argument("--skip-matrix", action="store_true", help="leave out the full built-in matrix")
    args = parser.parse_args()
    if not PEER_PYTHON.exists():
        raise SystemExit(f"no peer venv at {PEER_PYTHON}: run `make bench-speed`, which creates it")
    compile_sources()

    # Per check in one process: equivcheck warm, then the peer's own loop (three fresh workers a check).
    ec.check(*CORRECT)
    one_update = (one_update_of(CORRECT[0]), CORRECT[1])
    in_process, no_memory, per_update = alternated_seconds(
        lambda: ec.check(*CORRECT), lambda: ec.check(*CORRECT, measure_memory=False), lambda: ec.check(*one_update),
        repeats=args.repeats)
    ours = {"correct": verdict_of(ec.check(*CORRECT)), "buggy": verdict_of(ec.check(*BUGGY))}
    peer_rows = json.loads(process(str(PEER_PYTHON), str(BENCH / "peer_check.py"), "correct", "buggy").stdout)
    peer = {row["plan"]: peer_verdict(row["outcome"]) for row in peer_rows}
    peer_per_check = statistics.median(row["seconds"] for row in peer_rows)

    # Whole process, start to verdict, on the correct accumulation.
    cli = [str(BIN / "equivcheck"), "run", "--case", CORRECT[0], *(f"--regime={r}" for r in CORRECT[1])]
    our_cli, with_teardown, floor = alternated_processes(cli, [sys.executable, "-c", WITH_TEARDOWN, *cli[1:]],
                                                         [sys.executable, "-c", FLOOR], repeats=args.process_repeats)
    peer_cli = process_seconds([str(PEER_PYTHON), str(BENCH / "peer_check.py"), "correct"], args.peer_repeats)

    with_ours, bare_torch = alternated_processes([sys.executable, "-c", "import equivcheck"],
                                                 [sys.executable, "-c", "import torch"], repeats=args.process_repeats)
    pytest_ours, pytest_bare = alternated_processes([sys.executable, "-m", "pytest", "--help"],
                                                    [sys.executable, "-m", "pytest", "-p", "no:equivcheck", "--help"],
                                                    repeats=args.process_repeats)
    ec.check("mlp", ["ddp:world_size=2"])  # the warm pool, started before the clock
    fuzz, fuzzed, fuzzed_ddp = fuzz_seconds(args.examples)
    matrix = None if args.skip_matrix else process_seconds([str(BIN / "equivcheck"), "run"], 1)

    agree = ours["correct"].startswith("equivalent") == peer["correct"].startswith("equivalent") and \
        ours["buggy"].startswith("not") == peer["buggy"].startswith("not")
    rows = [
        ("in-process check, memory measured", f"{in_process * 1e3:.1f} ms", "", "", "<= 10 ms",
         in_process <= 0.010),
        ("  the same, measure_memory=False", f"{no_memory * 1e3:.1f} ms", "", f"memory costs {in_process / no_memory - 1:+.0%}",
         "", None),
        ("per check inside one process", f"{in_process * 1e3:.1f} ms", f"{peer_per_check:.2f} s",
         f"{peer_per_check / in_process:.0f}x faster", ">= 1000x", peer_per_check / in_process >= 1000),
        ("  the same check of one update, as the peer's", f"{per_update * 1e3:.1f} ms", f"{peer_per_check:.2f} s",
         f"{peer_per_check / per_update:.0f}x faster", "", None),
        ("CLI process start to verdict", f"{our_cli:.2f} s", f"{peer_cli:.2f} s", f"{peer_cli / our_cli:.1f}x faster",
         ">= 4x", peer_cli / our_cli >= 4),
        ("  the same, interpreter teardown kept", f"{with_teardown:.2f} s", "",
         f"teardown costs {with_teardown - our_cli:+.2f} s", "", None),
        ("  floor: import torch + one optimizer step", f"{floor:.2f} s", "", f"CLI = {our_cli / floor:.2f}x floor", "",
         None),
        ("verdict, correct accumulation (4 chunks)", ours["correct"], peer["correct"], "", "agree", None),
        ("verdict, clip per micro-batch (4 chunks)", ours["buggy"], peer["buggy"], "", "agree", agree),
        ("import equivcheck / import torch", f"{with_ours:.2f} s", f"{bare_torch:.2f} s",
         f"{with_ours / bare_torch:.2f}x", "<= 1.1x", with_ours / bare_torch <= 1.1),
        ("pytest --help, plugin on / off", f"{pytest_ours:.2f} s", f"{pytest_bare:.2f} s",
         f"{pytest_ours / pytest_bare:.2f}x", "<= 1.1x", pytest_ours / pytest_bare <= 1.1),
    ]
    rows.append((f"{fuzzed} hypothesis examples ({fuzzed_ddp} DDP)", f"{fuzz:.1f} s", "", "", "< 60 s", fuzz < 60))
    if matrix is not None:
        rows.append(("full built-in matrix (equivcheck run)", f"{matrix:.1f} s", "", "", "< 60 s", matrix < 60))
    print(f"medians: {args.repeats} in-process checks (alternated: with and without memory, one update), {args.process_repeats} processes, {args.peer_repeats} peer "
          f"processes, 2 peer checks in one process{'' if matrix is None else ', 1 matrix run'}; OMP_NUM_THREADS={THREADS}")
    header = ("measure", "equivcheck", "trainparity/base", "ratio", "target", "met")
    widths = (42, 34, 24, 24, 9, 4)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        met = "" if row[5] is None else ("yes" if row[5] else "NO")
        print("  ".join(str(c).ljust(w) for c, w in zip((*row[:5], met), widths)))


if __name__ == "__main__":
    main()
