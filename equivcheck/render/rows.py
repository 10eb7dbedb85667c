"""The report as JSON rows for machines: one row per outcome, the one JSON format of the CLI and the plugin."""

from __future__ import annotations

import dataclasses
import json
import math

from ..diff import kind_of
from ..judge.verdict import Outcome, Report, Status, Verdict
from ..process.kernels import decisions


def to_rows(report: Report) -> list[dict]:
    return [_row(o) for o in report.outcomes]


def json_document(rows: list[dict], interrupted: str | None = None) -> str:
    """The one JSON format of the CLI and the plugin: the status of the whole run beside every row."""
    status = "interrupted" if interrupted else Status.of(Verdict(r["verdict"]) for r in rows).value
    return json.dumps({"status": status, "interrupted": bool(interrupted), "kernels": kernel_paths(), "rows": rows},
                      indent=2) + "\n"


def kernel_paths() -> dict[str, str]:
    """The kernel path each probed precision ran on in this process, and why (kernels.py)."""
    return {name: decision.summary for name, decision in decisions().items()}


def _row(o: Outcome) -> dict:
    c = o.comparison
    return {
        "case": o.case,
        "regime": o.regime,
        "verdict": o.verdict.value,
        "max_abs": json_number(c.max_abs) if c else None,
        "max_rel": json_number(c.max_rel) if c else None,
        "margin": json_number(c.margin) if c else None,
        "first_divergent_step": c.first_divergent_step if c else None,
        "location": dataclasses.asdict(o.location) if o.location else None,  # where the run first parts
        "where": o.location.describe() if o.location else "",
        "hint": str(c.hint) if c else "",  # plain text: rows cross to xdist's controller
        "reason": o.reason,
        "seconds": round(o.seconds, 6),
        "optimizer_steps": o.result.optimizer_steps if o.result else None,
        "syncs": list(o.result.syncs) if o.result and o.result.syncs is not None else None,  # all-reduces per step
        "collectives": ([{kind: {"calls": calls, "bytes": sent} for kind, (calls, sent) in step.items()}
                         for step in o.result.collectives]
                        if o.result and o.result.collectives is not None else None),
        "peak_activation_bytes": o.memory.peak_bytes if o.memory else None,
        "memory_method": o.memory.method if o.memory else None,
        "memory_ratio": o.memory.ratio if o.memory else None,
        "memory_note": o.memory.note if o.memory else "",
        "problems": list(c.problems) if c else [],
        "problem_kinds": [kind.value if (kind := kind_of(p)) else None for p in (c.problems if c else ())],
        "mismatches": [
            {"kind": m.kind, "name": m.name, "first_step": m.first_step, "max_abs": json_number(m.diff.max_abs),
             "margin": json_number(m.diff.margin), "step_margins": [json_number(x) for x in m.step_margins]}
            for m in (c.mismatches if c else ())
        ],
    }


def json_number(value: float) -> float | str:
    """JSON has no infinity or NaN: those become the strings 'inf' and 'nan' (and None, nothing measured, null)."""
    return value if value is None or math.isfinite(value) else str(value)
