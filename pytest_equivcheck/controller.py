"""Controller: gathers the outcome rows of every test, on whichever process renders (the xdist
controller, or the only process), and writes the matrix and the JSON rows at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

PROPERTY = "equivcheck"  # the user_properties key under which a test's outcome rows travel


class Controller:
    def __init__(self, json_path: str | None) -> None:
        self.json_path = json_path
        self.rows: list[dict] = []  # {"row": the CLI's JSON row, "cell": the matrix cell text}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.rows += [entry for name, value in report.user_properties if name == PROPERTY for entry in value]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.rows:
            return
        from equivcheck.report import LEGEND, render_grid

        terminalreporter.write_sep("=", "equivcheck")
        terminalreporter.write_line(render_grid((r["row"]["case"], r["row"]["regime"], r["cell"]) for r in self.rows))
        terminalreporter.write_line(LEGEND)

    def pytest_sessionfinish(self) -> None:
        if self.json_path:
            Path(self.json_path).write_text(json.dumps([r["row"] for r in self.rows], indent=2) + "\n")
