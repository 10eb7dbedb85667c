"""Mechanics: the ``equivcheck`` fixture's object. One call checks a case or a team's step, records
the outcomes on the test (they travel to the xdist controller in ``user_properties``) and fails
the test with equivcheck's description of every mismatch.

Imported lazily (it imports torch): only tests that use equivcheck pay for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

import equivcheck as ec
from equivcheck.check import plan
from equivcheck.render import text as render
from equivcheck.render.rows import to_rows
from equivcheck.process.torch_imports import import_what_training_imports

from .controller import PROPERTY
from .deadline import deadline


class Checker:
    """Checks with the session's options and the test's marker keywords as defaults."""

    def __init__(self, node: pytest.Item, defaults: dict[str, object]) -> None:
        self._node = node
        self._defaults = {k: v for k, v in defaults.items() if v is not None}

    def check(self, case: ec.Case | str, regimes: Iterable[str | ec.Regime] | str | ec.Regime | None = None,
              **options) -> ec.Report:
        """Check ``case`` under ``regimes`` (default: its own list; one spec alone is that one regime, as
        ``ec.check`` takes it); fail the test unless all is as expected."""
        __tracebackhide__ = True
        # ec.check's own reading of the arguments (equivcheck.check.plan): one spec or a list, None the case's list
        distributed = any(spec.distributed for spec in plan(case, regimes).specs)
        return self._run(lambda kw: ec.check(case, regimes, **kw), options, f"check of {case}", distributed)

    def check_step(self, case: ec.Case | str, step: Callable, reference: object = None, **options) -> ec.Report:
        """Check a team's ``step(model, optimizer, batch)`` against ``reference`` (default: full batch);
        ``world_size=W`` runs it on W DDP ranks, ``mesh={"dp": D, "tp": T}`` with ``parallelize=`` on a mesh."""
        __tracebackhide__ = True
        return self._run(lambda kw: ec.check_step(case, step, **kw),
                         {**options, "reference": reference}, f"check_step of {case}", _on_ranks(options))

    def check_loop(self, case: ec.Case | str, loop: Callable, reference: object = None, **options) -> ec.Report:
        """Check a team's ``loop(model, optimizer, batches)`` against ``reference`` (default: full batch);
        ``world_size=W`` runs it on W ranks, ``mesh={"dp": D, "tp": T}`` with ``parallelize=`` on a mesh."""
        __tracebackhide__ = True
        return self._run(lambda kw: ec.check_loop(case, loop, **kw),
                         {**options, "reference": reference}, f"check_loop of {case}", _on_ranks(options))

    def audit(self, case: ec.Case | str, *, require: Iterable[str] = ()) -> ec.Audit:
        """Audit ``case`` (``ec.audit``); fail the test unless it catches every class of bug named in ``require``
        (a part of the class's name: ``"token normalisation"``)."""
        found = ec.audit(case, seed=self._defaults.get("seed", ec.DEFAULT_SEED), timeout=self._defaults.get("timeout"),
                         isolate=self._defaults.get("isolate", True), device=self._defaults.get("device"))
        missing = []
        for wanted in [require] if isinstance(require, str) else require:
            matching = [f for f in found.findings if wanted in f.pitfall]
            if not matching:
                raise pytest.UsageError(f"require={wanted!r} names no class of bug; the audit knows: "
                                        + "; ".join(f.pitfall for f in found.findings))
            missing += [f for f in matching if f.sensitivity is not ec.Sensitivity.CATCHES]
        if missing:
            pytest.fail(f"case {found.case} cannot catch what this test requires:\n" + "\n".join(
                f"  {f.pitfall}: {f.sensitivity.value}: {f.evidence}" for f in missing), pytrace=False)
        return found

    def check_eval(self, case: ec.Case | str, evaluate: Callable, **options) -> ec.EvalReport:
        """``ec.check_eval`` with the session's seed, timeout and backend; fail the test unless every metric on
        every rank matches the single-process one."""
        chosen = {k: v for k, v in self._defaults.items() if k in ("seed", "timeout", "backend")}
        report = ec.check_eval(case, evaluate, **{**chosen, **options})
        if not report.ok:
            pytest.fail(report.describe(), pytrace=False)
        return report

    def _run(self, checking: Callable[[dict], ec.Report], options: dict, what: str, distributed: bool) -> ec.Report:
        __tracebackhide__ = True  # a failure shows the test's line and equivcheck's description, not the plugin's frames
        allow_communication = options.pop("allow_communication", False)  # a gate's choice, not the check's
        kw = {**self._defaults, **{k: v for k, v in options.items() if v is not None}}
        # Distributed jobs are bounded by the pool, which tears itself down cleanly on a timeout; an alarm
        # could interrupt it half-way through a job. In-process checks are bounded by the alarm.
        timeout = kw.get("timeout")
        # Torch's lazy imports (what creating an optimizer imports: a second) happen before the alarm is set: they
        # are no part of the check's time, and an import the alarm cut short would break every later test here.
        import_what_training_imports()
        with deadline(None if distributed else timeout, what):
            report = checking(kw)
        record(self._node, report)
        report.assert_equivalent(allow_communication=allow_communication)
        skipped = [o for o in report.outcomes if o.verdict is ec.Verdict.SKIPPED]
        if skipped and len(skipped) == len(report.outcomes):  # this machine cannot run any of it (no GPUs)
            pytest.skip("; ".join(dict.fromkeys(o.reason for o in skipped)))
        return report


def _on_ranks(options: dict) -> bool:
    """Whether a team's code runs on ranks (the pool bounds it, not an alarm): on DDP ranks or on a mesh."""
    return options.get("world_size") is not None or options.get("mesh") is not None


def record(node: pytest.Item, report: ec.Report) -> None:
    rows = [{"row": row, "cell": render.cell(outcome)} for outcome, row in zip(report.outcomes, to_rows(report))]
    node.user_properties.append((PROPERTY, rows))
