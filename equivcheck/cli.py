"""The command line: ``equivcheck list``, ``run``, ``catalogue``, ``audit`` and ``field``; exit codes as pytest users
know them.

Ctrl-C and SIGTERM stop a run where it stands: the verdicts finished so far are written to the results files
and printed, the worker pools are stopped, and the exit code says the run was interrupted.
"""

from __future__ import annotations

import argparse
import json
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from .suites import catalogue as pitfall_catalogue
from .suites import field
from .render import html as html_report
from .render import text as render
from .render.markdown import render_markdown
from .render.rows import json_document, to_rows
from .render import terminal
from .suites.audit import audit
from .judge.verdict import Report, Status, Verdict
from .check import isolated, iter_outcomes, plan_all, regimes_for
from .runners.ranks import launcher
from .errors import Interrupted, InvalidArgument, ResultsNotWritten
from .runners.dispatch import DEFAULT_TIMEOUT
from .precision import PUBLIC_PRECISIONS
from .device import DEFAULT_DEVICE, DEVICES, chosen
from .process.exit import exit_without_teardown
from .render.progress import Progress
from .regimes import REGIMES, spec_usage
from .registry import all_cases, load_cases_from, resolve_case
from .render.files import check_writable, write_whole
from .process import torch_output


EXIT_CODES = {Status.OK: 0, Status.NOT_AS_EXPECTED: 1, Status.ERROR: 3, Status.NOTHING_CHECKED: 5}
EXIT_USAGE = 2
EXIT_INTERRUPTED = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal's number, as shells report it
EXIT_HELP = """exit status:
  0    every verdict as expected
  1    a verdict not as expected (a mismatch, an unexpected match, a reference that disagrees with itself,
       a synchronisation count alone unless --allow-communication)
  2    usage error (a bad option, regime spec or --cases-from file); nothing ran. Also: a results file could
       not be written (the others and the report are; the error names the path and the reason)
  3    a run errored (the code checked raised, a worker rank died or timed out, a run's process died of a
       signal) and nothing was found wrong
  5    nothing was checked (every check skipped, for example nccl with no GPU, or none planned)
  130  interrupted by Ctrl-C (SIGINT); 143 stopped by SIGTERM: the verdicts finished so far are written and printed
  141  the reader of the output went away (| head); every results file was written first

Results files are written whole or not at all, before the report: a temporary file beside each, renamed into
place; the file there before is kept until then. Torch's warnings and log lines raised while the checks train (in this
process, the isolating child or on ranks) go to a file of their own (--warnings), counted in the report's last line.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="equivcheck", description="Prove that ways of training agree with full-batch training.",
                                     epilog=EXIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list the cases and regimes")
    running = commands.add_parser("run", help="check cases under regimes and print the matrix", epilog=EXIT_HELP,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    catalogue = commands.add_parser("catalogue", help="measure every known pitfall and its faithful twin, per precision")
    auditing = commands.add_parser("audit", help="per class of bug, can each case catch it? (catches / blind, and why)")
    fielding = commands.add_parser("field", help="publicly reported training bugs, each checked as reported and as "
                                                 "fixed (caught, then equivalent)")
    fielding.add_argument("--family", action="append", choices=field.FAMILIES,
                          help="only this family's reports (repeatable; default: all)")
    fielding.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    for sub in (listing, running, catalogue, auditing):
        sub.add_argument("--cases-from", action="append", default=[], metavar="FILE_OR_MODULE",
                         help="import a .py file or module that registers cases (repeatable)")
    running.add_argument("--case", action="append", metavar="NAME", help="a case to check (repeatable; default: all)")
    running.add_argument("--regime", action="append", metavar="SPEC",
                         help="a regime spec such as accumulate:chunks=4 (repeatable; default: each case's own list)")
    running.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON rows to PATH")
    running.add_argument("--allow-communication", action="store_true",
                         help="exit 0 where the only finding is a synchronisation count (verdict 'communication')")
    running.add_argument("--matrix", action="store_true",
                         help="print the full matrix (case x regime) and the memory matrix, not only the overview "
                              "(printed anyway when something is not as expected)")
    running.add_argument("--html", metavar="PATH",
                         help="write a self-contained HTML report (matrix, divergence plots, memory) to PATH")
    running.add_argument("--plots", choices=html_report.PLOTS, default="failures",
                         help="which checks the HTML report plots: those not as expected (default), or every caught "
                              "pitfall too, to see what a known bug looks like beside your own failure")
    running.add_argument("--markdown", metavar="PATH",
                         help="write a compact Markdown summary to PATH (e.g. $GITHUB_STEP_SUMMARY)")
    running.add_argument("--backend", choices=("gloo", "nccl"),
                         help="process-group backend for distributed regimes (default: with --device cuda, nccl with a "
                              "GPU per rank where there are enough, else gloo)")
    running.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                         help=f"how long a distributed job's ranks, or a run in the isolating child, may go without progress "
                              f"(a step taken, a graph compiled) before it is a hang (default: {DEFAULT_TIMEOUT:g})")
    running.add_argument("--dtype", choices=PUBLIC_PRECISIONS, help="precision mode (default: each case's dtype)")
    running.add_argument("--threads", type=int, metavar="N",
                         help="torch intra-op threads per run (default: 1, unless OMP_NUM_THREADS is set)")
    catalogue.add_argument("--dtype", action="append", choices=PUBLIC_PRECISIONS,
                           help=f"precision mode (repeatable; default: {', '.join(pitfall_catalogue.DEFAULT_DTYPES)})")
    catalogue.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    catalogue.add_argument("--case", action="append", metavar="NAME",
                           help="only the entries on this case, as pitfall or twin (repeatable; default: every entry)")
    auditing.add_argument("--case", action="append", metavar="NAME", help="a case to audit (repeatable; default: all)")
    auditing.add_argument("--json", metavar="PATH", help="also write the findings as JSON rows to PATH")
    for sub in (running, catalogue, auditing, fielding):
        sub.add_argument("--warnings", metavar="PATH",
                         help="where torch's warnings and log lines raised while the checks trained are written, "
                              "counted in the last line, not printed between the report's (default: beside the first "
                              "results file, its name with .warnings.txt, else a new file in the temporary folder "
                              "where there are any)")
    for sub in (running, catalogue, auditing, fielding):
        sub.add_argument("--device", choices=DEVICES,
                         help=f"where every run trains (default: {DEFAULT_DEVICE}); ranks take a GPU each where there "
                              "are enough, else train over gloo on the CPU, the verdict saying so")
    for sub in (running, catalogue, auditing):
        sub.add_argument("--no-isolate", dest="isolate", action="store_false",
                         help="train in this process, not in a forked child: a debugger's breakpoints stop, but a run "
                              "that kills its process (SIGILL, SIGSEGV) ends the command instead of being an error")
    running.add_argument("--rtol", type=float, help="relative tolerance (with --atol)")
    running.add_argument("--atol", type=float, help="absolute tolerance (with --rtol)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _sigterm_interrupts():
            for source in getattr(args, "cases_from", ()):
                load_cases_from(source)
            with chosen(getattr(args, "device", None)):
                return {"list": _list, "run": _run, "catalogue": _catalogue, "audit": _audit,
                        "field": _field}[args.command](args)
    except InvalidArgument as error:
        print(f"equivcheck: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, Interrupted) as stop:  # before a run began, or while listing
        name = _signal_name(stop)
        print(f"equivcheck: interrupted by {name}", file=sys.stderr)
        return EXIT_INTERRUPTED[name]


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopping = False  # a stop signal has been raised: the command is keeping what finished and stopping its ranks


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the command the way Ctrl-C does (an exception in the main thread), not silently; neither
    is lost in a finalizer, and a second one while the command stops is ignored (see :func:`_interrupt`)."""
    global _stopping
    previous = {signum: signal.signal(signum, _interrupt) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stopping = False


REDELIVER_AFTER = 0.01  # seconds: a signal that landed in a finalizer comes again once the finalizer is done


def _interrupt(signum: int, frame) -> None:
    """Raise KeyboardInterrupt (SIGINT) or Interrupted (SIGTERM) in the main thread. Python runs a handler
    between any two bytecodes, finalizers (``__del__``) included, and an exception raised there is printed and
    dropped: the command would go on and a traceback would reach the terminal. So inside a finalizer the
    signal is sent again a moment later, when the main thread is back in ordinary code.

    Once the command is stopping (a second Ctrl-C, or SIGTERM after Ctrl-C), a signal changes nothing: raised
    again, it would break off the stop itself (ranks left to their parent-watch, the report or JSON half
    written, a traceback); the stop is bounded, its ranks killed within a second of their pool's close."""
    global _stopping
    if _stopping:
        return
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            again = threading.Timer(REDELIVER_AFTER, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        frame = frame.f_back
    _stopping = True
    raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted("SIGTERM")


def _signal_name(stop: BaseException) -> str:
    return "SIGTERM" if isinstance(stop, Interrupted) else "SIGINT"


def _check_outputs(*options: tuple[str, str | None]) -> None:
    """Every results path checked before anything runs; nothing is opened or truncated until the results exist."""
    for option, path in options:
        if path is not None:
            check_writable(option, path)


def _write_results(*files: tuple[str | None, Callable[[], str]]) -> list[ResultsNotWritten]:
    """Each results file written whole, before the terminal report: a reader that closes the pipe or a Ctrl-C while
    it prints loses none of them. One that cannot be written keeps the others; it is told after the report."""
    unwritten = []
    for path, render_text in files:
        if path is not None:
            try:
                write_whole(path, render_text())
            except ResultsNotWritten as error:
                unwritten.append(error)
    return unwritten


def _told(unwritten: list[ResultsNotWritten], code: int) -> int:
    """Say which results files could not be written; the run then exits 2, unless it was interrupted."""
    for error in unwritten:
        print(f"equivcheck: error: {error}", file=sys.stderr)
    return EXIT_USAGE if unwritten and code not in EXIT_INTERRUPTED.values() else code


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away


def entry() -> None:
    """The ``equivcheck`` command: :func:`main`, then an exit that skips the interpreter's teardown.

    A reader that stops early (``equivcheck list | head``) closes the pipe: that ends the command quietly,
    as it ends any Unix tool, not with a traceback."""
    try:
        code = main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush into the pipe
        code = EXIT_BROKEN_PIPE
    for signum in STOP_SIGNALS:  # the exit handlers stop the ranks within a second; a signal now only interrupts that
        signal.signal(signum, signal.SIG_IGN)
    exit_without_teardown(code)


def _list(args: argparse.Namespace) -> int:
    print("cases:")
    for case in all_cases().values():
        shape = (f"{case.steps} x {case.batch_size}" + ("-" if case.last_batch == "keep" else "")
                 + (f" x {case.epochs} epochs" if case.epochs > 1 else ""))  # "-": the last batch may be smaller
        print(f"  {case.name:<28} {shape:<8} {case.description}")
    print("\nregimes:")
    for name, cls in REGIMES.items():
        usage = spec_usage(name)  # a long one on a line of its own, the summary under it
        print(f"  {usage:<32} {cls.summary}" if len(usage) <= 32 else f"  {usage}\n  {'':<32} {cls.summary}")
    print("\ndefault regimes per case: " + "; ".join(f"{c.name}: {', '.join(regimes_for(c))}"
                                                     for c in all_cases().values() if c.regimes is not None))
    return 0


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    plans = plan_all(args.case, args.regime, rtol=args.rtol, atol=args.atol, backend=args.backend,
                     timeout=args.timeout, dtype=args.dtype, threads=args.threads, isolate=args.isolate)
    _check_outputs(("--json", args.json), ("--html", args.html), ("--markdown", args.markdown),
                   ("--warnings", args.warnings))
    runner = isolated(plans)  # one forked child for the whole matrix
    outcomes, interrupted = [], None
    progress = Progress(sum(len(p.specs) for p in plans), "checks")
    with torch_output.gathering() as said:
        try:
            for plan in plans:
                for outcome in iter_outcomes(plan, runner=runner):  # each outcome kept as it arrives
                    outcomes.append(outcome)
                    progress.step(f"{outcome.case} {outcome.regime}")
        except (KeyboardInterrupt, Interrupted) as stop:  # the pool in flight closed itself; keep what finished
            interrupted = _signal_name(stop)
        finally:
            progress.close()
            runner.close()
            launcher.leave_group()
    report = Report(tuple(outcomes))
    gated = [Verdict.EQUIVALENT if args.allow_communication and o.verdict is Verdict.COMMUNICATION else o.verdict
             for o in report.outcomes]  # numbers that match pass the gate; the verdict itself is still reported
    code = EXIT_INTERRUPTED[interrupted] if interrupted else EXIT_CODES[Status.of(gated)]
    if launcher.active() and launcher.rank() != 0:
        return code  # every rank ran the same checks; rank 0 reports them
    rows = to_rows(report)
    noise = _warnings_path(args, "run", said, args.json, args.html, args.markdown)
    unwritten = _write_results(
        (args.json, lambda: json_document(rows, interrupted)),
        (args.markdown, lambda: render_markdown(rows)),
        (args.html, lambda: html_report.render_html(rows, _metadata(args, plans), args.plots)),
        (noise, lambda: torch_output.describe(said, "run")))
    if report.outcomes:
        print(terminal.render_overview(rows, _width(), colour=_colour()) if sys.stdout.isatty()
              else render.render_overview(rows, _width()))
    if report.outcomes and (args.matrix or not report.ok):
        print("\n" + render.render_matrix(report, _width()))
        print(render.LEGEND)
        print("\n" + render.render_memory(report))
    if render.render_skips(report):
        print(render.render_skips(report))
    if report.failures:
        print("\n" + render.render_failures(report))
    print("\n" + render.render_summary(report, time.perf_counter() - started, interrupted))
    failed = {error.path for error in unwritten}
    written = [f"{what} {path}" for what, path in (("JSON", args.json), ("HTML", args.html), ("Markdown", args.markdown))
               if path and path not in failed]
    print("; ".join(([] if args.matrix or not report.ok else ["full matrix: equivcheck run --matrix"])
                    + (written or ["an HTML report with divergence plots: --html PATH"])
                    + _warnings_told(said, noise, failed)))
    return _told(unwritten, code)


WARNINGS_SUFFIX = ".warnings.txt"


def _warnings_path(args: argparse.Namespace, command: str, said: list, *results: str | None) -> str | None:
    """Where torch's warnings go: --warnings, else beside the first results file asked for (report.html:
    report.warnings.txt), else, where there are any, a new file in the temporary folder (None: none, nowhere)."""
    if args.warnings:
        return args.warnings
    first = next((path for path in results if path and _exists_but_not_special(path)), None)
    if first is not None:
        return os.path.splitext(first)[0] + WARNINGS_SUFFIX
    if not said:
        return None
    descriptor, path = tempfile.mkstemp(prefix=f"equivcheck-{command}-", suffix=WARNINGS_SUFFIX)
    os.close(descriptor)
    return path


def _exists_but_not_special(path: str) -> bool:
    """A results path a file can sit beside: not /dev/stdout, a FIFO or another special file."""
    return not os.path.exists(path) or os.path.isfile(path)


def _warnings_told(said: list, path: str | None, failed: set[str]) -> list[str]:
    """The last line's part about torch's warnings: how many, and the file that holds them."""
    if not said or path is None:
        return []
    if path in failed:
        return [f"{torch_output.count_words(said)} (not written: see the error below)"]
    return [f"{torch_output.count_words(said)}, written to {path}"]


def _width() -> int:
    """The terminal's width where there is one; 120 in a pipe, as before."""
    return shutil.get_terminal_size((120, 40)).columns if sys.stdout.isatty() else 120


def _colour() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _metadata(args: argparse.Namespace, plans: list) -> dict[str, str]:
    return html_report.run_metadata(seed=plans[0].seed if plans else 0, dtype=args.dtype, backend=args.backend,
                                    world_sizes=[spec.world_size for plan in plans for spec in plan.specs])


def _catalogue(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    _check_outputs(("--json", args.json), ("--warnings", args.warnings))
    entries = pitfall_catalogue.entries_on(args.case)
    with torch_output.gathering() as said:
        rows = pitfall_catalogue.run_catalogue(args.dtype or pitfall_catalogue.DEFAULT_DTYPES, entries,
                                               isolate=args.isolate)
    noise = _warnings_path(args, "catalogue", said, args.json)
    unwritten = _write_results((args.json, lambda: _json_text(pitfall_catalogue.to_rows(rows))),
                               (noise, lambda: torch_output.describe(said, "catalogue")))
    print(pitfall_catalogue.render_catalogue(rows))
    print(pitfall_catalogue.CATALOGUE_LEGEND)
    met = pitfall_catalogue.targets_met(rows)
    skipped = sorted({row.dtype for row in rows if row.skipped})
    status = "every target met" if met else f"{sum(bool(r.shortfalls) for r in rows)} rows miss a target"
    pitfalls = len(entries)
    print(f"\n{len(rows)} rows ({pitfalls} pitfalls x {len(rows) // max(pitfalls, 1)} "
          f"precisions); {status}" + (f"; skipped: {', '.join(skipped)}" if skipped else "")
          + f" in {time.perf_counter() - started:.1f} s"
          + "".join(f"; {part}" for part in _warnings_told(said, noise, {e.path for e in unwritten})))
    return _told(unwritten, 0 if met else 1)


def _audit(args: argparse.Namespace) -> int:
    """Informational: every finding printed, exit 0; a gate on a finding belongs in a test (``ec.audit``)."""
    names = args.case or list(all_cases())
    for name in names:
        resolve_case(name)  # every name known before anything trains
    _check_outputs(("--json", args.json), ("--warnings", args.warnings))
    with torch_output.gathering() as said:
        audits = [audit(name, isolate=args.isolate) for name in names]
    noise = _warnings_path(args, "audit", said, args.json)
    unwritten = _write_results((args.json, lambda: _json_text([row for a in audits for row in a.to_rows()])),
                               (noise, lambda: torch_output.describe(said, "audit")))
    print("\n\n".join(a.describe() for a in audits))
    told = _warnings_told(said, noise, {e.path for e in unwritten})
    if told:
        print("\n" + told[0])
    return _told(unwritten, 0)


def _field(args: argparse.Namespace) -> int:
    """Exit 0 where every row holds (the bug caught as reported, equivalent as fixed), else 1."""
    started = time.perf_counter()
    _check_outputs(("--json", args.json), ("--warnings", args.warnings))
    with torch_output.gathering() as said:
        rows = field.run_field(args.family)
    noise = _warnings_path(args, "field", said, args.json)
    unwritten = _write_results((args.json, lambda: _json_text(field.to_rows(rows))),
                               (noise, lambda: torch_output.describe(said, "field")))
    print(field.render(rows))
    broken = [row for row in rows if not row.holds]
    for row in broken:
        print(f"\n{row.bug.reference} ({row.module}) does not hold: as reported {row.buggy.describe()}; "
              f"as fixed {row.fixed.describe()}")
    located, declared = field.located_share(rows)
    if declared:
        print(f"\nlocated where the fix acts: {located} of the {declared} caught rows that declare where it acts")
    print(f"\n{field.totals(row.bug for row in rows)}; "
          + (f"{len(broken)} rows do not hold" if broken else "every row holds")
          + f" in {time.perf_counter() - started:.1f} s"
          + "".join(f"; {part}" for part in _warnings_told(said, noise, {e.path for e in unwritten})))
    return _told(unwritten, 1 if broken else 0)


def _json_text(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2) + "\n"
