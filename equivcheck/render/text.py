"""The report as text for people: the overview, the matrix, the memory matrix, failures, skips and the summary line.
Built from outcomes, or from JSON rows (:mod:`equivcheck.render.rows`) where they came from other processes."""

from __future__ import annotations

from collections.abc import Iterable

from ..diff import kind_of
from ..judge.verdict import Outcome, Report, Status, Verdict
from ..judge.memory import format_bytes

LABELS = {
    Verdict.EQUIVALENT: "ok",
    Verdict.EXPECTED_MISMATCH: "caught",
    Verdict.MISMATCH: "MISMATCH",
    Verdict.UNEXPECTED_MATCH: "MISSED",
    Verdict.NONDETERMINISTIC: "NONDET",
    Verdict.SKIPPED: "skipped",
    Verdict.ERROR: "ERROR",
    Verdict.COMMUNICATION: "COMM",
}
LEGEND = (
    "cell: verdict, margin (greatest error / allowed error; below 1 matches) and the phase where a run parts. "
    "ok = equivalent, "
    "caught = declared pitfall reported, MISMATCH = not equivalent, MISSED = declared pitfall not seen, "
    "NONDET = reference disagrees with itself, COMM = numbers match but synchronisation count does not"
)


def cell(outcome: Outcome) -> str:
    label = LABELS[outcome.verdict]
    if outcome.comparison is None:
        return f"{label} (crash)" if outcome.verdict is Verdict.EXPECTED_MISMATCH else label
    comparison = outcome.comparison
    if comparison.problems and comparison.margin <= 1:  # the numbers match; the structure does not
        return f"{label} ({problem_label(comparison.problems[0])})"
    where = f" {comparison.location.phase}" if comparison.location is not None else ""  # where it parts
    return f"{label} {comparison.margin:.0e}{where}"


def problem_label(problem: str) -> str:
    """What a cell says of a problem: its kind (a problem made by hand, with no kind, is just a problem)."""
    kind = kind_of(problem)
    return "problem" if kind is None else kind.value


NAME_WIDTH = 60  # a case's name in a table: longer ones are cut, so one cannot push every column off screen


def shown(name: str) -> str:
    """A case's name as a table shows it: whole up to NAME_WIDTH characters, else its start and end around '...'
    (the JSON rows keep it whole)."""
    if len(name) <= NAME_WIDTH:
        return name
    half = (NAME_WIDTH - 3) // 2
    return f"{name[:half]}...{name[-(NAME_WIDTH - 3 - half):]}"


def render_matrix(report: Report, width: int = 120, *, cell=cell) -> str:
    return render_grid(((o.case, o.regime, cell(o)) for o in report.outcomes), width)


def render_grid(cells: Iterable[tuple[str, str, str]], width: int = 120) -> str:
    """Rows are cases, columns regimes, in the order they ran; '.' where a pair was not checked.

    Takes ``(case, regime, cell text)`` triples, so cells gathered from other processes render too.
    Columns that would not fit in ``width`` go on to a further panel, which repeats the case
    column and lists only the cases checked under its regimes.
    """
    cells = {(case, regime): text for case, regime, text in cells}
    cases = list(dict.fromkeys(case for case, _ in cells))
    regimes = list(dict.fromkeys(regime for _, regime in cells))
    case_width = max(len("case"), *(len(shown(c)) for c in cases)) if cases else len("case")
    column_width = {r: max(len(r), *(len(cells.get((c, r), ".")) for c in cases)) for r in regimes}
    panels, used = [[]], case_width
    for regime in regimes:
        if panels[-1] and used + 2 + column_width[regime] > width:
            panels.append([])
            used = case_width
        panels[-1].append(regime)
        used += 2 + column_width[regime]
    return "\n\n".join(
        render_columns([["case", *panel]] + [[shown(c), *(cells.get((c, r), ".") for r in panel)]
                                             for c in cases if any((c, r) in cells for r in panel)])
        for panel in panels
    )


def render_columns(table: list[list[str]]) -> str:
    """Left-aligned columns under a ruled header row."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def memory_cell(outcome: Outcome) -> str:
    memory = outcome.memory
    if memory is None or memory.peak_bytes is None:
        return "-"
    ratio = "" if memory.ratio is None else f" {memory.ratio:.2f}x"
    return format_bytes(memory.peak_bytes) + ratio + ("!" if memory.note else "")


def render_memory(report: Report) -> str:
    """The peak activation memory matrix, its legend, and a line for each regime that saves nothing."""
    methods = sorted({o.memory.method for o in report.outcomes if o.memory and o.memory.method})
    lines = [render_matrix(report, cell=memory_cell),
             f"cell: peak activation memory ({', '.join(methods) or 'not measured'}) and its ratio to the "
             "reference (full_batch); ! = accumulates gradients but saves no memory"]
    lines += [f"{o.case} under {o.regime} {o.memory.note} (peak {o.memory.ratio:.3f}x the reference's)"
              for o in report.outcomes if o.memory and o.memory.note]
    return "\n".join(lines)


def render_failures(report: Report) -> str:
    return "\n\n".join(f"FAILED {o.describe()}" + (f"\n{o.details}" if o.details else "") for o in report.failures)


def render_skips(report: Report) -> str:
    """Each distinct reason a check was skipped, once."""
    reasons = dict.fromkeys(o.reason for o in report.outcomes if o.verdict is Verdict.SKIPPED)
    return "\n".join(f"skipped: {reason}" for reason in reasons)


def render_summary(report: Report, seconds: float, interrupted: str | None = None) -> str:
    counts: dict[str, int] = {}
    for o in report.outcomes:
        counts[o.verdict.value] = counts.get(o.verdict.value, 0) + 1
    tally = ", ".join(f"{n} {verdict}" for verdict, n in counts.items()) or "none finished"
    if interrupted:
        status = f"interrupted by {interrupted}"
    elif report.status is Status.NOTHING_CHECKED:
        status = ("nothing was checked: every check was skipped" if report.outcomes
                  else "nothing was checked: no check was planned")
    else:
        status = "all as expected" if report.ok else f"{len(report.failures)} not as expected"
    return f"{len(report.outcomes)} checks: {tally}; {status} in {seconds:.1f} s"


AS_EXPECTED = {Verdict.EQUIVALENT.value, Verdict.EXPECTED_MISMATCH.value, Verdict.SKIPPED.value}
RED, RESET = "\033[31m", "\033[0m"


def overview_table(rows: list[dict]) -> list[list[str]]:
    """Per case: its verdicts counted, then what was not as expected, else the pitfalls it caught with their
    margins. Built from JSON rows, so the plugin renders it under xdist as the CLI does."""
    cases: dict[str, list[dict]] = {}
    for row in rows:
        cases.setdefault(row["case"], []).append(row)
    table = [["case", "verdicts", "not as expected / pitfalls caught (margin)"]]
    for case, found in cases.items():
        counts: dict[str, int] = {}
        for row in found:
            label = LABELS[Verdict(row["verdict"])]
            counts[label] = counts.get(label, 0) + 1
        wrong = [f"{LABELS[Verdict(r['verdict'])]} {r['regime']} {shown_margin(r)}" for r in found
                 if r["verdict"] not in AS_EXPECTED]
        caught = [f"{r['regime']} {shown_margin(r)}" for r in found if r["verdict"] == Verdict.EXPECTED_MISMATCH.value]
        table.append([shown(case), ", ".join(f"{n} {label}" for label, n in counts.items()),
                      "; ".join(wrong or caught) or "-"])
    return table


def render_overview(rows: list[dict], width: int = 120, *, colour: bool = False) -> str:
    """The overview as text that fits ``width`` columns; cases not as expected in red when ``colour``."""
    table = overview_table(rows)
    lines = render_columns(table).splitlines()
    lines = [line if len(line) <= width else line[: width - 3] + "..." for line in lines]
    if colour:
        bad = cases_not_as_expected(rows)
        lines = lines[:2] + [f"{RED}{line}{RESET}" if row[0] in bad else line for row, line in zip(table[1:], lines[2:])]
    return "\n".join(lines)


def cases_not_as_expected(rows: list[dict]) -> set[str]:
    """The cases with a verdict not as expected (shown in red on a terminal), by name as the overview shows them."""
    return {shown(row["case"]) for row in rows if row["verdict"] not in AS_EXPECTED}


def shown_margin(row: dict) -> str:
    """As a matrix cell shows it: the margin, or what failed where the numbers match (communication)."""
    if row["margin"] is None:
        return "(crash)" if row["verdict"] == Verdict.EXPECTED_MISMATCH.value else ""
    if row["problems"] and float(row["margin"]) <= 1:
        return f"({row['problem_kinds'][0] or 'problem'})"
    return f"{float(row['margin']):.0e}"
