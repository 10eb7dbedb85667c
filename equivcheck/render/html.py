"""The HTML report: one self-contained file a person reads in a browser.

It holds the run's metadata, the overview, the full matrix, every check that was not as expected with
its divergence plotted per optimizer step (greatest error / allowed error per quantity, log scale, the
tolerance at 1), and the memory and communication columns as bars. It is rendered from the JSON rows,
so the CLI and the plugin (under xdist too) write the same file. Plots need matplotlib (the ``report``
extra); without it the report keeps its tables and says how to get them.
"""

from __future__ import annotations

import datetime
import html
import io
import math

import torch

from .._version import __version__
from .text import AS_EXPECTED, LABELS, overview_table
from .rows import kernel_paths
from ..judge.verdict import Status, Verdict
from ..device import auto_backend

PLOTS_MISSING = "Divergence plots need matplotlib: pip install 'equivcheck[report]'."
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 100%; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.9em; }
p { overflow-wrap: anywhere; }
.scroll { overflow-x: auto; max-width: 100%; }
.scroll table { margin: 0; }
table.matrix th { max-width: 9em; vertical-align: bottom; font-weight: normal; font-size: 0.8em; }
table.matrix td { white-space: nowrap; }
table.matrix th:first-child, table.matrix td:first-child { position: sticky; left: 0; background: #fff;
  font-weight: bold; white-space: nowrap; z-index: 1; }
figure.divergence svg { max-width: 100%; height: auto; }
td.ok { background: #e8f5e9; } td.caught { background: #fff8e1; } td.bad { background: #ffebee; font-weight: bold; }
.bar { background: #90caf9; height: 0.9em; display: inline-block; vertical-align: middle; }
.status-ok { color: #2e7d32; } .status-bad { color: #c62828; }
"""


def run_metadata(*, seed: int, dtype: str | None, backend: str | None, world_sizes: list[int] | None) -> dict[str, str]:
    """What a reader needs to reproduce the run."""
    return {"equivcheck": __version__, "torch": torch.__version__, "seed": str(seed),
            "precision": dtype or "each case's own", "backend": backend or f"auto: {auto_backend()}",
            "world sizes": ", ".join(map(str, sorted(set(world_sizes)))) if world_sizes else "as each check asked",
            "written": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")} | (
        {"kernels": "; ".join(kernel_paths().values())} if kernel_paths() else {})


PLOTS = ("failures", "all")  # which checks get a divergence plot: those not as expected, or caught pitfalls too


def render_html(rows: list[dict], metadata: dict[str, str], plots: str = "failures") -> str:
    """The page; with ``plots='all'`` the caught pitfalls get their divergence plots too, in a section of their own:
    what a known bug looks like, beside a failure of one's own."""
    status = Status.of(Verdict(r["verdict"]) for r in rows)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>equivcheck report</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>equivcheck: <span class='status-{'ok' if status is Status.OK else 'bad'}'>"
             f"{_e(status.value.replace('_', ' '))}</span></h1>",
             _table(["", ""], [[k, v] for k, v in metadata.items()], caption="run"),
             "<h2 id='overview'>Overview</h2>", _table(*_split(overview_table(rows))),
             "<h2 id='matrix'>Matrix</h2>", _matrix(rows),
             "<h2 id='not-as-expected'>Not as expected</h2>", _failures(rows),
             *(["<h2 id='caught-pitfalls'>Caught pitfalls</h2>", _caught(rows)] if plots == "all" else []),
             "<h2 id='memory'>Memory and communication</h2>", _resources(rows),
             "</body></html>"]
    return "\n".join(parts)


def write_html(path: str, rows: list[dict], metadata: dict[str, str], plots: str = "failures") -> None:
    with open(path, "w") as file:
        file.write(render_html(rows, metadata, plots))


def _e(text: object) -> str:
    return html.escape(str(text))


def _split(table: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    return table[0], table[1:]


def _table(header: list[str], body: list[list[str]], *, caption: str = "", raw: bool = False, css: str = "") -> str:
    """A table of escaped text, in a box that scrolls sideways where it is wider than the page. ``raw``: each body
    cell is a whole ``<td>`` element and each header HTML already (classes, bars, break points), made by the caller."""
    cell = (lambda c: c) if raw else _e
    head = "".join(f"<th>{cell(h)}</th>" for h in header) if any(header) else ""
    rows = "".join("<tr>" + "".join(c if raw else f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in body)
    opening = f"<table class='{css}'>" if css else "<table>"
    return (f"<div class='scroll'>{opening}{f'<caption>{_e(caption)}</caption>' if caption else ''}"
            f"{f'<tr>{head}</tr>' if head else ''}{rows}</table></div>")


def _css(verdict: str) -> str:
    if verdict == Verdict.EQUIVALENT.value:
        return "ok"
    return "caught" if verdict in AS_EXPECTED else "bad"


def _matrix(rows: list[dict]) -> str:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    cells = {(r["case"], r["regime"]): r for r in rows}
    body = []
    for case in cases:
        line = [f"<td>{_e(case)}</td>"]
        for regime in regimes:
            row = cells.get((case, regime))
            if row is None:
                line.append("<td>.</td>")
                continue
            margin = "" if row["margin"] is None else f" {float(row['margin']):.0e}"
            line.append(f"<td class='{_css(row['verdict'])}' title='{_e(row['where'] or row['hint'] or row['reason'])}'>"
                        f"{_e(LABELS[Verdict(row['verdict'])] + margin)}</td>")
        body.append(line)
    return _table(["case", *map(_breakable, regimes)], body, raw=True, css="matrix")


def _breakable(spec: str) -> str:
    """A regime spec that may wrap after its colon and commas (``ddp_step:world_size=2,fn=...``): a column as narrow
    as its cells, not as its name."""
    return _e(spec).replace(":", ":<wbr>").replace(",", ",<wbr>")


def _failures(rows: list[dict]) -> str:
    failed = [r for r in rows if r["verdict"] not in AS_EXPECTED]
    return _details(failed) if failed else "<p>Every verdict is as expected.</p>"


def _caught(rows: list[dict]) -> str:
    caught = [r for r in rows if r["verdict"] == Verdict.EXPECTED_MISMATCH.value]
    return _details(caught) if caught else "<p>No declared pitfall was checked.</p>"


def _details(rows: list[dict]) -> str:
    """Each check's reasons, its divergence plotted per optimizer step, and its mismatched quantities."""
    parts = []
    for row in rows:
        parts.append(f"<h3>{_e(row['case'])} under {_e(row['regime'])}: {_e(row['verdict'])}</h3>")
        parts += [f"<p>{_e(text)}</p>" for text in (row["where"], row["hint"], row["reason"], *row["problems"])
                  if text]
        if any(m.get("step_margins") for m in row["mismatches"]):
            figure = divergence_figure(row)
            parts.append(f"<p>{_e(PLOTS_MISSING)}</p>" if figure is None else _svg(figure))
        if row["mismatches"]:
            parts.append(_table(["quantity", "first step", "greatest error / allowed", "per step"],
                                [[f"{m['kind']} {m['name']}", "final" if m["first_step"] is None else m["first_step"],
                                  f"{float(m['margin']):.3g}",
                                  ", ".join(f"{float(x):.2g}" for x in m.get("step_margins", []))]
                                 for m in row["mismatches"]]))
    return "\n".join(parts)


def divergence_figure(row: dict):
    """A row's divergence per optimizer step as a matplotlib ``Figure`` (greatest error / allowed error of
    each quantity, log scale, the allowed error at 1), or None without matplotlib. The object API leaves
    pyplot's global state, and the user's backend, alone."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    figure = Figure(figsize=(7, 3.2))
    axes = figure.subplots()
    for mismatch in (m for m in row["mismatches"] if m.get("step_margins")):
        margins = [min(max(float(x), 1e-12), 1e300) if math.isfinite(float(x)) else 1e300
                   for x in mismatch["step_margins"]]
        axes.plot(range(len(margins)), margins, marker="o", label=f"{mismatch['kind']} {mismatch['name']}")
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1, label="allowed error")
    axes.set_yscale("log")
    axes.set_xlabel("optimizer step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("greatest error / allowed")
    axes.set_title(f"{row['case']} under {row['regime']}", fontsize=9)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    return figure


def _svg(figure) -> str:
    svg = io.StringIO()
    figure.savefig(svg, format="svg")
    return "<figure class='divergence'>" + svg.getvalue().split("?>", 1)[-1] + "</figure>"


def _resources(rows: list[dict]) -> str:
    measured = [r for r in rows if r["peak_activation_bytes"] is not None]
    if not measured:
        return "<p>Nothing measured.</p>"
    widest = max(r["memory_ratio"] or 0 for r in measured) or 1.0
    body = []
    for r in measured:
        ratio = r["memory_ratio"]
        bar = "" if ratio is None else f"<span class='bar' style='width:{200 * ratio / widest:.0f}px'></span> {ratio:.2f}x"
        syncs = r.get("syncs")
        body.append([f"<td>{_e(r['case'])}</td>", f"<td>{_e(r['regime'])}</td>",
                     f"<td>{_e(r['peak_activation_bytes'])}</td>", f"<td>{bar}</td>",
                     f"<td>{_e(', '.join(map(str, syncs)) if syncs else '-')}</td>"])
    return _table(["case", "regime", "peak activation bytes", "of the reference's", "all-reduces per step"], body,
                  raw=True)
