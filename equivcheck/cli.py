"""The command line: ``equivcheck list``, ``run`` and ``catalogue``. Exit 0 as expected, 1 not, 2 usage."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from . import catalogue as pitfall_catalogue
from . import report as render
from .check import check_all, regimes_for
from .distributed import launcher
from .errors import InvalidArgument
from .execute import DEFAULT_TIMEOUT
from .precision import PRECISIONS
from .process_exit import exit_without_teardown
from .regimes import REGIMES
from .registry import all_cases, load_cases_from


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="equivcheck", description="Prove that ways of training agree with full-batch training.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list the cases and regimes")
    running = commands.add_parser("run", help="check cases under regimes and print the matrix")
    catalogue = commands.add_parser("catalogue", help="measure every known pitfall and its faithful twin, per precision")
    for sub in (listing, running, catalogue):
        sub.add_argument("--cases-from", action="append", default=[], metavar="FILE_OR_MODULE",
                         help="import a .py file or module that registers cases (repeatable)")
    running.add_argument("--case", action="append", metavar="NAME", help="a case to check (repeatable; default: all)")
    running.add_argument("--regime", action="append", metavar="SPEC",
                         help="a regime spec such as accumulate:chunks=4 (repeatable; default: each case's own list)")
    running.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON rows to PATH")
    running.add_argument("--backend", choices=("gloo", "nccl"),
                         help="process-group backend for distributed regimes (default: nccl with a GPU per rank, else gloo)")
    running.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                         help=f"limit for one distributed job on its ranks (default: {DEFAULT_TIMEOUT:g})")
    running.add_argument("--dtype", choices=PRECISIONS, help="precision mode (default: each case's dtype)")
    catalogue.add_argument("--dtype", action="append", choices=PRECISIONS,
                           help=f"precision mode (repeatable; default: {', '.join(pitfall_catalogue.DEFAULT_DTYPES)})")
    catalogue.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    running.add_argument("--rtol", type=float, help="relative tolerance (with --atol)")
    running.add_argument("--atol", type=float, help="absolute tolerance (with --rtol)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for source in args.cases_from:
            load_cases_from(source)
        return {"list": _list, "run": _run, "catalogue": _catalogue}[args.command](args)
    except InvalidArgument as error:
        print(f"equivcheck: error: {error}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``equivcheck`` command: :func:`main`, then an exit that skips the interpreter's teardown."""
    exit_without_teardown(main())


def _list(args: argparse.Namespace) -> int:
    print("cases:")
    for case in all_cases().values():
        shape = f"{case.steps} x {case.batch_size}"
        print(f"  {case.name:<28} {shape:<8} {case.description}")
    print("\nregimes:")
    for name, cls in REGIMES.items():
        params = ",".join(f"{f.name}=K" for f in dataclasses.fields(cls))
        spec = f"{name}:{params}" if params else name
        print(f"  {spec:<32} {cls.summary}")
    print("\ndefault regimes per case: " + "; ".join(f"{c.name}: {', '.join(regimes_for(c))}"
                                                     for c in all_cases().values() if c.regimes is not None))
    return 0


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        report = check_all(args.case, args.regime, rtol=args.rtol, atol=args.atol, backend=args.backend,
                           timeout=args.timeout, dtype=args.dtype)
    finally:
        launcher.leave_group()
    if launcher.active() and launcher.rank() != 0:
        return 0 if report.ok else 1  # every rank ran the same checks; rank 0 reports them
    print(render.render_matrix(report))
    print(render.LEGEND)
    print("\n" + render.render_memory(report))
    if render.render_skips(report):
        print(render.render_skips(report))
    if report.failures:
        print("\n" + render.render_failures(report))
    if args.json:
        render.write_json(report, args.json)
    print("\n" + render.render_summary(report, time.perf_counter() - started))
    return 0 if report.ok else 1


def _catalogue(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    rows = pitfall_catalogue.run_catalogue(args.dtype or pitfall_catalogue.DEFAULT_DTYPES)
    print(pitfall_catalogue.render_catalogue(rows))
    print(pitfall_catalogue.CATALOGUE_LEGEND)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(pitfall_catalogue.to_rows(rows), out, indent=2)
            out.write("\n")
    met = pitfall_catalogue.targets_met(rows)
    skipped = sorted({row.dtype for row in rows if row.skipped})
    status = "every target met" if met else f"{sum(bool(r.shortfalls) for r in rows)} rows miss a target"
    print(f"\n{len(rows)} rows ({len(pitfall_catalogue.CATALOGUE)} pitfalls x {len(rows) // max(len(pitfall_catalogue.CATALOGUE), 1)} "
          f"precisions); {status}" + (f"; skipped: {', '.join(skipped)}" if skipped else "")
          + f" in {time.perf_counter() - started:.1f} s")
    return 0 if met else 1
