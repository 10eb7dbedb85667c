"""Controller: gathers the outcome rows of every test, on whichever process renders (the xdist
controller, or the only process), and writes the JSON rows, the HTML report and the Markdown summary at the
end of the session, each whole or not at all (``equivcheck.render.files``), before the terminal summary
prints the matrix. A file that cannot be written keeps the others and ends the session with exit 4."""

from __future__ import annotations

import pytest

PROPERTY = "equivcheck"  # the user_properties key under which a test's outcome rows travel


class Controller:
    def __init__(self, json_path: str | None, html_path: str | None = None, markdown_path: str | None = None,
                 metadata: dict[str, object] | None = None, plots: str = "failures") -> None:
        self.json_path, self.html_path, self.markdown_path, self.plots = json_path, html_path, markdown_path, plots
        self.metadata = metadata or {}
        self.order: dict[str, int] = {}  # test id -> its place in the collection
        self.arrived: list[tuple[str, dict]] = []  # (test id, {"row": the CLI's JSON row, "cell": its text})
        self.unwritten: list[str] = []  # why each results file that could not be written was not

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.order = {item.nodeid: i for i, item in enumerate(session.items)}

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self.order = {nodeid: i for i, nodeid in enumerate(ids)}  # every worker collects the same tests

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.arrived += [(report.nodeid, entry)
                             for name, value in report.user_properties if name == PROPERTY for entry in value]

    @property
    def rows(self) -> list[dict]:
        """In collection order, whichever order xdist workers finished in: the same matrix for -n 0 and -n 2."""
        ranked = sorted(enumerate(self.arrived), key=lambda a: (self.order.get(a[1][0], len(self.order)), a[0]))
        return [entry for _, (_, entry) in ranked]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = self.rows
        if rows:
            from equivcheck.render.text import LEGEND, render_grid

            terminalreporter.write_sep("=", "equivcheck")
            terminalreporter.write_line(render_grid((r["row"]["case"], r["row"]["regime"], r["cell"]) for r in rows))
            terminalreporter.write_line(LEGEND)
        for reason in self.unwritten:
            terminalreporter.write_line(f"ERROR: equivcheck: {reason}",
                                        red=True)

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter's summary, and before any other plugin's teardown
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        files = [(path, render) for path, render in ((self.json_path, self._json), (self.markdown_path, self._markdown),
                                                      (self.html_path, self._html)) if path]
        if not files:
            return
        from equivcheck.errors import ResultsNotWritten
        from equivcheck.render.files import write_whole

        rows = [r["row"] for r in self.rows]
        for path, render in files:
            try:
                write_whole(path, render(rows))
            except ResultsNotWritten as error:
                self.unwritten.append(str(error))
        if self.unwritten:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR

    def _json(self, rows: list[dict]) -> str:
        from equivcheck.render.rows import json_document

        return json_document(rows)

    def _markdown(self, rows: list[dict]) -> str:
        from equivcheck.render.markdown import render_markdown

        return render_markdown(rows, title="equivcheck (pytest)")

    def _html(self, rows: list[dict]) -> str:
        from equivcheck.render.html import render_html, run_metadata

        return render_html(rows, run_metadata(**self.metadata), self.plots)
