"""The overview on a terminal. With rich installed (``pip install 'equivcheck[terminal]'``) it is rich's
table: long cells wrap to the terminal's width instead of being cut, and cases not as expected are red;
without rich it is the plain columns of :func:`equivcheck.render.text.render_overview`. In a pipe the CLI
prints the plain columns either way. rich is imported here, on a terminal only, so neither
``import equivcheck`` nor ``pytest --help`` pays for it."""

from __future__ import annotations

import io

from . import text as render


def render_overview(rows: list[dict], width: int, *, colour: bool) -> str:
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return render.render_overview(rows, width, colour=colour)
    cells = render.overview_table(rows)
    bad = render.cases_not_as_expected(rows)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold" if colour else "")
    case, counts, findings = cells[0]
    table.add_column(case, no_wrap=True)  # a case's name stays whole: it is what a reader looks for
    table.add_column(counts)
    table.add_column(findings, overflow="fold")
    for row in cells[1:]:
        table.add_row(*row, style="red" if colour and row[0] in bad else "")
    console = Console(file=io.StringIO(), width=width, force_terminal=colour, no_color=not colour,
                      color_system="standard" if colour else None, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().rstrip("\n").splitlines())
