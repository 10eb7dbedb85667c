"""The pitfall catalogue: every known way accumulation goes wrong, next to the faithful way, measured.

An entry names a registered case that declares the pitfall regime an expected mismatch, and the
faithful twin that does the same job right: by default the twin the pitfall regime declares on its
class (``Regime.pitfall``). Running the catalogue checks both in each precision mode and holds them to
the targets: a pitfall caught with a margin (error / allowed error) of at least
``PITFALL_MARGIN[mode]``, a twin passing with a headroom (allowed / error) of at least
``TWIN_HEADROOM[mode]``. Entries run through :func:`check`, so an entry whose regime runs elsewhere
(a DDP regime) joins with :func:`add_entry` and nothing else changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ..judge.verdict import Outcome, Verdict
from ..check import Plan, isolated, iter_outcomes, plan
from ..errors import InvalidArgument
from ..process.kernels import decisions
from ..precision import PRECISIONS, Tolerance, resolve_precision
from ..regimes import Pitfall, parse_regime
from ..registry import all_cases, get_case
from ..render.rows import json_number
from ..render.text import render_columns
from ..process.seeding import DEFAULT_SEED

# Targets per mode (issue 5). A mode without a pitfall target reports caught or not and holds no line.
PITFALL_MARGIN = {"float64": 100.0, "float32": 10.0}
TWIN_HEADROOM = {"float64": 100.0}
# A row judged at a lossy regime's own error bound (a compressing DDP comm hook) holds these instead, in the
# modes that hold targets: the bound is the compression's, not reordering's, so the twin has a few times
# its measured error of room (fp16 over 2 ranks: about 10), not orders of magnitude.
OWN_BOUND_PITFALL_MARGIN = 10.0
OWN_BOUND_TWIN_HEADROOM = 2.0
# The four modes every pitfall is measured in by default; the precision policies (bf16, bf16-master) on request
# (--dtype), their own tests holding a faithful regime and a planted fault under each.
DEFAULT_DTYPES = ("float64", "float32", "bf16-autocast", "fp16-autocast")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One pitfall: ``regime`` on ``case`` must be caught; ``twin`` on ``twin_case`` (default ``case``) must pass.
    ``twin`` defaults to the faithful twin ``regime`` declares (its class's ``pitfall``); name one where the row
    holds something else against it (a faithful regime on a case that breaks it, beside one that does not)."""

    pitfall: str
    case: str
    regime: str
    twin: str | None = None
    twin_case: str | None = None
    reference: str = "full_batch"

    def __post_init__(self) -> None:
        if self.twin is None:
            declared = type(parse_regime(self.regime)).pitfall
            if not isinstance(declared, Pitfall):
                raise InvalidArgument(f"catalogue entry {self.pitfall!r}: twin=None is not allowed: regime "
                                      f"{self.regime!r} declares no faithful twin (its class's pitfall is "
                                      f"{declared!r}): expected the twin's spec")
            object.__setattr__(self, "twin", str(declared.twin_of(self.regime)))
        for argument in ("regime", "twin", "reference"):
            object.__setattr__(self, argument, str(parse_regime(getattr(self, argument))))

    @property
    def fixed_case(self) -> str:
        return self.twin_case or self.case


# Every pitfall with its faithful twin. Each entry sits beside the cases it uses (equivcheck_cases' modules
# add theirs with add_entry when they register their cases); ``catalogue_entries()`` loads them first.
CATALOGUE: list[Entry] = []


def catalogue_entries() -> list[Entry]:
    """The catalogue, with the built-in cases (and their entries) loaded."""
    all_cases()
    return list(CATALOGUE)


def entries_on(cases: Sequence[str] | None) -> list[Entry]:
    """The entries whose pitfall or twin trains on one of ``cases`` (None: every entry); a name no case has, or no
    entry uses, is refused naming the cases the catalogue uses."""
    entries = catalogue_entries()
    if cases is None:
        return entries
    used = sorted({name for entry in entries for name in (entry.case, entry.fixed_case)})
    for name in cases:
        if name not in used:
            raise InvalidArgument.value("case", name, "a case the catalogue uses: " + ", ".join(used))
    return [entry for entry in entries if {entry.case, entry.fixed_case} & set(cases)]


def add_entry(entry: Entry) -> Entry:
    """Add a row, from the module that registers its case; that case must declare the pitfall regime a mismatch."""
    if not isinstance(entry, Entry):
        raise InvalidArgument.type("entry", entry, "an equivcheck.suites.catalogue.Entry")
    if any(e.pitfall == entry.pitfall for e in CATALOGUE):
        raise InvalidArgument.value("pitfall", entry.pitfall, "a pitfall not in the catalogue yet")
    CATALOGUE.append(entry)
    return entry


@dataclasses.dataclass(frozen=True)
class Row:
    """One entry measured in one precision mode: the pitfall's outcome and the twin's."""

    entry: Entry
    dtype: str
    pitfall: Outcome
    twin: Outcome

    @property
    def skipped(self) -> bool:
        return Verdict.SKIPPED in (self.pitfall.verdict, self.twin.verdict)

    @property
    def caught(self) -> bool:
        return self.pitfall.comparison is not None and not self.pitfall.comparison.ok

    @property
    def margin(self) -> float | None:
        return self.pitfall.comparison.margin if self.pitfall.comparison else None

    @property
    def caught_by_count(self) -> bool:
        """Caught by an exact count (all-reduces, optimizer steps) while every number matches: no margin to
        hold to a target, and none needed, a count is never near its tolerance."""
        return self.caught and not self.pitfall.comparison.mismatches

    @property
    def twin_passes(self) -> bool:
        return self.twin.verdict is Verdict.EQUIVALENT

    @property
    def headroom(self) -> float | None:
        c = self.twin.comparison
        return None if c is None else (float("inf") if c.margin == 0 else 1 / c.margin)

    @property
    def tolerance(self) -> Tolerance | None:
        c = self.pitfall.comparison or self.twin.comparison
        return c.tolerance if c else None

    @property
    def own_bound(self) -> bool:
        """Judged at a lossy regime's own error bound (its tolerance names its source), not the mode's."""
        return any(o.comparison is not None and bool(o.comparison.tolerance.source) for o in (self.pitfall, self.twin))

    @property
    def targets(self) -> tuple[float | None, float | None]:
        """(pitfall margin, twin headroom) this row must reach; None: caught, or passes, is enough."""
        margin, headroom = PITFALL_MARGIN.get(self.dtype), TWIN_HEADROOM.get(self.dtype)
        if self.own_bound:
            margin = None if margin is None else OWN_BOUND_PITFALL_MARGIN
            headroom = None if headroom is None else OWN_BOUND_TWIN_HEADROOM
        return margin, headroom

    @property
    def shortfalls(self) -> tuple[str, ...]:
        """What keeps this row from its targets (empty: met, or skipped with its reason shown)."""
        if self.skipped:
            return ()
        missing = []
        margin, headroom = self.targets
        if not self.twin_passes:
            missing.append(f"twin {self.entry.twin} is {self.twin.verdict.value}, not equivalent")
        elif headroom is not None and self.headroom < headroom:
            missing.append(f"twin headroom {self.headroom:.3g} < {headroom:g}")
        if self.pitfall.verdict is Verdict.ERROR or (margin is not None and not self.caught):
            missing.append(f"pitfall {self.entry.regime} not caught ({self.pitfall.verdict.value})")
        elif margin is not None and not self.caught_by_count and self.margin < margin:
            missing.append(f"pitfall margin {self.margin:.3g} < {margin:g}")
        return tuple(missing)


def run_catalogue(
    dtypes: Iterable[str] = DEFAULT_DTYPES, entries: Sequence[Entry] | None = None, *, seed: int = DEFAULT_SEED,
    isolate: bool = False,
) -> list[Row]:
    """Measure every entry in every precision mode; the rows come grouped by mode. ``isolate``: the runs train in
    one forked child (check's ``isolate``), so a precision whose kernels kill their process gives error rows."""
    modes = [resolve_precision(d).name for d in dtypes]
    entries = catalogue_entries() if entries is None else list(entries)
    for entry in entries:  # usage errors before anything runs
        for name, spec in ((entry.case, entry.regime), (entry.fixed_case, entry.twin)):
            parse_regime(spec).validate(get_case(name))
        if entry.regime not in _declared(entry):
            raise InvalidArgument(f"catalogue entry {entry.pitfall!r}: case {entry.case!r} does not declare "
                                  f"{entry.regime!r} in expect_mismatch: expected the pitfall declared by its case")
    def planned(case: str, specs: list[str], entry: Entry, mode: str) -> Plan:
        return plan(case, specs, reference=entry.reference, dtype=mode, seed=seed, isolate=isolate)

    plans = {}
    for mode in modes:
        for entry in entries:
            if entry.twin_case is None:
                plans[entry, mode] = [planned(entry.case, [entry.twin, entry.regime], entry, mode)]
            else:
                plans[entry, mode] = [planned(entry.case, [entry.regime], entry, mode),
                                      planned(entry.twin_case, [entry.twin], entry, mode)]
    runner = isolated(p for each in plans.values() for p in each)  # one forked child for every row
    try:
        rows = []
        for (entry, mode), each in plans.items():
            outcomes = [o for p in each for o in iter_outcomes(p, runner=runner)]
            pitfall, twin = outcomes if entry.twin_case else outcomes[::-1]
            rows.append(Row(entry, mode, pitfall, twin))
        return rows
    finally:
        runner.close()


def _declared(entry: Entry) -> set[str]:
    """The exact specs the case declares, and the spec itself when its regime name is declared."""
    declared = get_case(entry.case).expect_mismatch
    name = parse_regime(entry.regime).name
    return {str(parse_regime(k)) for k in declared if ":" in k} | ({entry.regime} if name in declared else set())


def targets_met(rows: Iterable[Row]) -> bool:
    return not any(row.shortfalls for row in rows)


def render_catalogue(rows: Sequence[Row]) -> str:
    """One block per precision mode: its tolerance and targets, then a line per pitfall."""
    blocks = []
    for mode in dict.fromkeys(row.dtype for row in rows):
        block = [row for row in rows if row.dtype == mode]
        header = _mode_header(mode, block)
        if all(row.skipped for row in block):
            blocks.append(f"{header}\n  skipped: {block[0].pitfall.reason or block[0].twin.reason}")
            continue
        table = [["pitfall", "pitfall regime", "max abs err", "margin", "caught", "faithful twin", "max abs err",
                  "headroom", "passes", "targets"]]
        for row in block:
            if row.skipped:  # a row this machine cannot run says so in every column that would judge it
                reason = next(o.reason for o in (row.pitfall, row.twin) if o.verdict is Verdict.SKIPPED)
                table.append([row.entry.pitfall, _spec(row.entry.case, row.entry.regime), "-", "-", "skipped",
                              _spec(row.entry.fixed_case, row.entry.twin), "-", "-", "skipped", f"skipped: {reason}"])
                continue
            table.append([
                row.entry.pitfall, _spec(row.entry.case, row.entry.regime), _err(row.pitfall),
                "count" if row.caught_by_count else _num(row.margin),
                "yes" if row.caught else "NO", _spec(row.entry.fixed_case, row.entry.twin), _err(row.twin),
                _num(row.headroom), "yes" if row.twin_passes else "NO",
                ("met" if not row.shortfalls else "MISSED: " + "; ".join(row.shortfalls))
                + (f" (at its own bound: {_own_targets(row)})" if row.own_bound else ""),
            ])
        blocks.append(header + "\n" + render_columns(table))
    return "\n\n".join(blocks)


CATALOGUE_LEGEND = (
    "margin = greatest error / allowed error (above 1: caught; count: the numbers match and an exact count, "
    "such as all-reduces per step, catches it); headroom = allowed error / greatest error of the "
    "twin (above 1: passes); allowed error of an element = atol + rtol * |reference|; max abs err = greatest "
    "absolute difference from full-batch training over every gradient, weight, buffer and loss; a row "
    "'at its own bound' is judged at a lossy regime's error bound (a compressing DDP comm hook: the mode's "
    "tolerance plus the compression's), which its check's reason states"
)


def _own_targets(row: Row) -> str:
    margin, headroom = row.targets
    wants = [f"pitfall margin >= {margin:g}" if margin is not None else "",
             f"twin headroom >= {headroom:g}" if headroom is not None else "twin passes"]
    return ", ".join(filter(None, wants))


def _mode_header(mode: str, block: Sequence[Row]) -> str:
    tol = next((row.tolerance for row in block if row.tolerance and not row.own_bound), None)
    allowed = f"allowed error {tol.atol:g} + {tol.rtol:g} * |reference|" if tol else "tolerance n/a"
    wants = []
    if mode in PITFALL_MARGIN:
        wants.append(f"pitfall margin >= {PITFALL_MARGIN[mode]:g}")
    wants.append(f"twin headroom >= {TWIN_HEADROOM[mode]:g}" if mode in TWIN_HEADROOM else "twin passes")
    kernels = decisions().get(mode)  # a probed precision says which kernels it ran on, and why
    return (f"{mode} ({PRECISIONS[mode].description}; {allowed}; targets: {', '.join(wants)})"
            + (f"\n  kernels: {kernels.summary}" if kernels else ""))


def _spec(case: str, regime: str) -> str:
    return f"{regime} on {case}"


def _err(outcome: Outcome) -> str:
    return "-" if outcome.comparison is None else f"{outcome.comparison.max_abs:.1e}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0e}"


def to_rows(rows: Iterable[Row]) -> list[dict]:
    """JSON-ready records, one per entry and mode."""
    return [{
        "pitfall": row.entry.pitfall, "dtype": row.dtype, "case": row.entry.case, "regime": row.entry.regime,
        "twin_case": row.entry.fixed_case, "twin": row.entry.twin, "skipped": row.skipped,
        "reason": row.pitfall.reason if row.skipped else "",
        "rtol": row.tolerance.rtol if row.tolerance else None, "atol": row.tolerance.atol if row.tolerance else None,
        "pitfall_max_abs": _json(row.pitfall.comparison.max_abs) if row.pitfall.comparison else None,
        "pitfall_margin": _json(row.margin), "caught": row.caught, "caught_by_count": row.caught_by_count,
        "hint": row.pitfall.comparison.hint if row.pitfall.comparison else "",
        "twin_max_abs": _json(row.twin.comparison.max_abs) if row.twin.comparison else None,
        "twin_headroom": _json(row.headroom), "twin_passes": row.twin_passes, "shortfalls": list(row.shortfalls),
    } for row in rows]


def _json(value: float | None) -> float | str | None:
    return None if value is None else json_number(value)
