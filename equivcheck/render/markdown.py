"""A compact Markdown summary of JSON rows: what a CI job shows from ``$GITHUB_STEP_SUMMARY``."""

from __future__ import annotations

from ..judge.verdict import Status, Verdict
from .text import AS_EXPECTED, overview_table, shown_margin


def render_markdown(rows: list[dict], title: str = "equivcheck") -> str:
    """A compact Markdown summary (what a CI job shows from ``$GITHUB_STEP_SUMMARY``): the overview, then
    each check that was not as expected with where it parts, its hint or reason."""
    status = Status.of(Verdict(r["verdict"]) for r in rows).value
    header, *body = overview_table(rows)
    lines = [f"## {title}: {status.replace('_', ' ')}", "", "| " + " | ".join(header) + " |", "|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    failed = [r for r in rows if r["verdict"] not in AS_EXPECTED]
    if failed:
        lines += ["", "### Not as expected", ""]
        lines += [f"- **{r['case']}** under `{r['regime']}`: {r['verdict']} {shown_margin(r)}".rstrip()
                  + "".join(f"; {text}" for text in (r["where"], r["hint"], r["reason"]) if text)
                  for r in failed]
    return "\n".join(lines) + "\n"
