"""The field: publicly reported training bugs, each reproduced as its team wrote it and as it was fixed.

The pitfall catalogue holds bugs equivcheck's own authors wrote; this holds the ones that shipped. Each module
of ``equivcheck_cases.field`` reproduces one report, scaled down to a tiny model, through the public API only
(``check_step``, ``check_loop``, ``check_eval``, ``world_size=``, ``wrap=``, ``optimizer_wrap=``,
``pipeline=True``), the way a team would gate its own code. It declares:

- ``BUG``: a :class:`Bug`, the report it comes from (its docstring says what went wrong);
- ``buggy()`` and ``fixed()``: the check of the code as reported and as fixed, returning the
  :class:`~equivcheck.Report` or :class:`~equivcheck.EvalReport` the team would assert on.

A row holds when the code as reported is caught and the code as fixed is equivalent. A bug the API cannot
express keeps its row, saying why (``Bug.not_expressible``); one equivcheck misses keeps it too
(``Bug.known_miss``): its row holds while it is still missed, so a fix shows up as a row to update. A bug in torch
itself lives in some of its versions (``Bug.torch_from``, ``Bug.torch_before``): on another torch the code as
reported trains right, and the row holds where both checks are equivalent, no false alarm on either.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType

import torch

from ..diff import PHASES, Location
from ..judge.verdict import Report, Verdict
from ..errors import BlindSpotWarning, InvalidArgument
from ..evaluation import EvalReport
from ..render.rows import json_number
from ..render.text import render_columns

PACKAGE = "equivcheck_cases.field"
# The families of the field, in the order the table shows them (the list). The last four are the 2025-2026
# families: optimizers that need whole matrices under sharding, low-precision policies, norms and clipping across
# meshes, adapters on frozen bases.
FAMILIES = ("accumulation", "ddp", "fsdp", "zero", "pipeline", "checkpointing", "evaluation", "tensor", "resume",
            "compile", "moe", "optimizer", "precision", "clipping", "adapters", "packing")
KINDS = ("issue", "pull")


@dataclasses.dataclass(frozen=True)
class Bug:
    """A public report: ``repository`` (``owner/name``), the ``kind`` (``issue`` or ``pull``) and ``number`` of the
    thread, ``fixed_by`` (``pull #N``, a commit) where another thread holds the fix, the ``family`` it belongs to and
    a one-line ``summary`` of what went wrong. ``not_expressible`` / ``known_miss``: why the row cannot be checked, or
    why equivcheck does not catch it (both empty: the bug must be caught and its fix found equivalent)."""

    repository: str
    kind: str
    number: int
    family: str
    summary: str
    fixed_by: str = ""
    not_expressible: str = ""
    known_miss: str = ""
    torch_from: str = ""  # a bug in torch itself: the first version it was measured in
    torch_before: str = ""  # and the first it was measured gone from
    # Where the fix acted, read from the fixing change: the phase of a step (diff.PHASES) and, where it has one, the
    # module of the check's model it acts in ("backward blocks.1", "loss"), or "compiler" where torch.compile's code
    # is what was fixed (its eager source trains right); the caught row's location is held to it.
    fix_acts: str = ""

    def __post_init__(self) -> None:
        if self.repository.count("/") != 1:
            raise InvalidArgument.value("repository", self.repository, "'owner/name'")
        if self.kind not in KINDS:
            raise InvalidArgument.value("kind", self.kind, " or ".join(map(repr, KINDS)))
        if self.family not in FAMILIES:
            raise InvalidArgument.value("family", self.family, ", ".join(map(repr, FAMILIES)))
        if self.not_expressible and self.known_miss:
            raise InvalidArgument("a bug is either not expressible or a known miss, not both")
        if self.fix_acts and self.fix_acts.split()[0] not in PHASES:
            raise InvalidArgument.value("fix_acts", self.fix_acts, f"a phase ({', '.join(PHASES)}), then the module "
                                        "it acts in where it has one ('backward blocks.1')")
        for argument in ("torch_from", "torch_before"):
            version = getattr(self, argument)
            if version and not re.fullmatch(r"\d+(\.\d+)*", version):
                raise InvalidArgument.value(argument, version, "a torch release such as '2.13' or '2.15.0'")

    @property
    def fix_location(self) -> tuple[str, str] | None:
        """``fix_acts`` as (phase, module): None where the row declares none."""
        if not self.fix_acts:
            return None
        phase, _, module = self.fix_acts.partition(" ")
        return phase, module.strip()

    @property
    def reference(self) -> str:
        return f"{self.repository}#{self.number}"

    @property
    def absent(self) -> str:
        """Why the installed torch cannot show this bug (outside the versions it lives in); empty where it can."""
        version = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
        if (self.torch_from and version < self.torch_from) or (self.torch_before and version >= self.torch_before):
            since = f"from torch {self.torch_from}" if self.torch_from else ""
            until = f"before {'' if since else 'torch '}{self.torch_before}" if self.torch_before else "on"
            window = " ".join(filter(None, (since, "to" if since and self.torch_before else "", until)))
            return f"torch {version} has no such bug (measured {window})"
        return ""

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repository}/{'pull' if self.kind == 'pull' else 'issues'}/{self.number}"

    @property
    def expected(self) -> tuple[str, str] | None:
        """What the buggy and the fixed check must find: caught and equivalent, unless the bug is a known miss."""
        if self.not_expressible:
            return None
        if self.absent:
            return ("equivalent", "equivalent")
        return ("missed" if self.known_miss else "caught", "equivalent")


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one check found, in the field's terms: ``caught`` (with the margin, error / allowed, or by an exact
    count), ``equivalent`` (with the headroom, allowed / error), ``missed`` (equivalent where a bug was reproduced),
    ``error`` or ``skipped``, and why."""

    state: str
    margin: float | None = None
    by_count: bool = False
    detail: str = ""
    location: Location | None = None  # where a caught run parts from its reference (judge/locate/)

    def describe(self) -> str:
        if self.state == "caught":
            return "caught by count" if self.by_count else f"caught, margin {_figure(self.margin)}"
        if self.state in ("equivalent", "missed") and self.margin is not None:
            return f"{self.state}, headroom {_figure(1 / self.margin if self.margin else float('inf'))}"
        return f"{self.state}: {self.detail}" if self.detail else self.state


def finding_of(report: Report | EvalReport) -> Finding:
    """A check's report as a finding; of several outcomes, the first that is not equivalent."""
    if isinstance(report, EvalReport):
        if report.ok:
            return Finding("equivalent", report.margin)
        return Finding("caught", report.margin, detail="; ".join(report.problems), location=report.location)
    if not isinstance(report, Report):
        raise InvalidArgument(f"a field check returned {report!r}: expected an equivcheck Report or EvalReport "
                              "(what check_step, check_loop or check_eval return)")
    for outcome in report.outcomes:
        if outcome.verdict is Verdict.EQUIVALENT:
            continue
        if outcome.verdict in (Verdict.MISMATCH, Verdict.COMMUNICATION):
            margin = outcome.comparison.margin if outcome.comparison is not None else None
            return Finding("caught", margin, by_count=outcome.verdict is Verdict.COMMUNICATION, detail=outcome.reason,
                           location=outcome.location)
        if outcome.verdict is Verdict.SKIPPED:
            return Finding("skipped", detail=outcome.reason)
        return Finding("error", detail=f"{outcome.verdict.value}: {outcome.reason}")
    margins = [o.comparison.margin for o in report.outcomes if o.comparison is not None]
    return Finding("equivalent", max(margins, default=None))


@dataclasses.dataclass(frozen=True)
class Row:
    """One report, checked: the module that reproduces it, and what the buggy and the fixed code gave."""

    module: str
    bug: Bug
    buggy: Finding | None
    fixed: Finding | None
    seconds: float = 0.0

    @property
    def holds(self) -> bool:
        """The row is as its module declares: the bug caught (or still missed, where declared) and the fix
        equivalent; a row that cannot be expressed holds by saying why."""
        if self.bug.expected is None:
            return True
        return (self.buggy.state, self.fixed.state) == self.bug.expected

    @property
    def located(self) -> bool | None:
        """Whether the caught run was located where its fix acts (``Bug.fix_acts``): the same phase, and inside the
        declared module where one is declared. None where the row declares none or was not caught."""
        declared = self.bug.fix_location
        if declared is None or self.buggy is None or self.buggy.state != "caught":
            return None  # nothing to hold it to
        found = self.buggy.location
        if found is None or found.phase != declared[0]:
            return False
        module = declared[1]
        return not module or found.module == module or found.module.startswith(f"{module}.")


def modules(families: Iterable[str] | None = None) -> list[ModuleType]:
    """Every module of the field (a family's only, where given), imported, in the table's order."""
    chosen = set(FAMILIES if families is None else families)
    for family in chosen:
        if family not in FAMILIES:
            raise InvalidArgument.value("family", family, ", ".join(map(repr, FAMILIES)))
    package = importlib.import_module(PACKAGE)
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        bug = getattr(module, "BUG", None)
        if not isinstance(bug, Bug):
            raise InvalidArgument(f"field module {module.__name__} has no BUG = Bug(...): every module cites its report")
        if bug.family in chosen:
            found.append(module)
    return sorted(found, key=lambda m: (FAMILIES.index(m.BUG.family), m.BUG.repository.lower(), m.BUG.number))


def check_module(module: ModuleType) -> Row:
    """Run one module's two checks; an exception in either is that check's error, and the other still runs."""
    bug = module.BUG
    if bug.not_expressible:
        return Row(module.__name__, bug, None, None)
    started = time.perf_counter()
    with warnings.catch_warnings():  # a tiny case's blind spots for other classes of bug: the row says what it caught
        warnings.simplefilter("ignore", BlindSpotWarning)
        buggy, fixed = (_found(getattr(module, name)) for name in ("buggy", "fixed"))
    if bug.absent:
        buggy = dataclasses.replace(buggy, detail="; ".join(filter(None, (bug.absent, buggy.detail))))
    elif bug.known_miss and buggy.state == "equivalent":
        buggy = dataclasses.replace(buggy, state="missed", detail=bug.known_miss)
    return Row(module.__name__, bug, buggy, fixed, time.perf_counter() - started)


def _found(check: Callable[[], Report | EvalReport]) -> Finding:
    try:
        return finding_of(check())
    except Exception as error:  # noqa: BLE001 (the row says what went wrong; the rest of the field runs)
        last = traceback.extract_tb(error.__traceback__)[-1]
        return Finding("error", detail=f"{type(error).__name__}: {error} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})")


def run_field(families: Iterable[str] | None = None) -> list[Row]:
    return [check_module(module) for module in modules(families)]


def totals(bugs: Iterable[Bug]) -> str:
    """The line the command ends with and the README shows: what the corpus declares, family by family."""
    bugs = list(bugs)
    families = [f for f in FAMILIES if any(b.family == f for b in bugs)]
    per_family = ", ".join(f"{f} {sum(b.family == f for b in bugs)}" for f in families)
    checked = [b for b in bugs if not b.not_expressible]
    return (f"{len(bugs)} reported bugs ({per_family}): {sum(not b.known_miss for b in checked)} caught as reported "
            f"and equivalent as fixed, {sum(bool(b.known_miss) for b in checked)} known misses, "
            f"{sum(bool(b.not_expressible) for b in bugs)} not expressible")


def render(rows: list[Row]) -> str:
    """The table, one line per report; why a report is not expressible, or missed, follows it as a numbered note."""
    table = [["family", "report", "what went wrong", "as reported", "parts (fix acts)", "as fixed", "holds"]]
    notes = []
    for row in rows:
        why = row.bug.not_expressible or row.bug.known_miss or row.bug.absent
        if why:
            notes.append(f"[{len(notes) + 1}] {row.bug.reference}: {why}")
        marker = f" [{len(notes)}]" if why else ""
        if row.bug.not_expressible:
            buggy, fixed = f"not expressible{marker}", "-"
        else:
            buggy, fixed = row.buggy.describe() + marker, row.fixed.describe()
        table.append([row.bug.family, row.bug.reference, row.bug.summary, buggy, _where(row), fixed,
                      "yes" if row.holds else "NO"])
    return "\n".join([render_columns(table), *([""] + notes if notes else [])])


def _where(row: Row) -> str:
    """Where the caught run parts (phase and module, or unsaid), then where its fix acts where they differ:
    ``backward blocks.1``, ``gradient 0 (fix: communication)``; "-" where nothing is held to it."""
    found = None if row.buggy is None else row.buggy.location
    said = "unsaid" if found is None else " ".join(filter(None, (found.phase, found.module)))
    if row.located is None:
        return said if found is not None else "-"
    return said if row.located else f"{said} (fix: {row.bug.fix_acts})"


def located_share(rows: Iterable[Row]) -> tuple[int, int]:
    """Of the caught rows that declare where their fix acts, how many were located there, and how many there are."""
    judged = [row.located for row in rows if row.located is not None]
    return sum(judged), len(judged)


def to_rows(rows: list[Row]) -> list[dict]:
    def finding(found: Finding | None) -> dict | None:
        return None if found is None else {"state": found.state, "margin": json_number(found.margin),
                                           "by_count": found.by_count, "detail": found.detail,
                                           "location": None if found.location is None else
                                           dataclasses.asdict(found.location)}

    return [{"module": row.module, "report": row.bug.reference, "url": row.bug.url, "family": row.bug.family,
             "summary": row.bug.summary, "fixed_by": row.bug.fixed_by, "not_expressible": row.bug.not_expressible,
             "known_miss": row.bug.known_miss, "buggy": finding(row.buggy), "fixed": finding(row.fixed),
             "fix_acts": row.bug.fix_acts, "located": row.located,
             "holds": row.holds, "seconds": round(row.seconds, 3)} for row in rows]


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
