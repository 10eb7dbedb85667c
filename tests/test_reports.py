"""Reports people read: the one-screen overview, Markdown for CI, the HTML report with divergence plots,
progress on a terminal. Each parsed for its content, not only checked to exist."""

import html.parser
import io
import json
import re
import shutil
import subprocess
import sys

import pytest

import equivcheck as ec
from equivcheck.render import text as render
from equivcheck.render.rows import to_rows
from equivcheck.render import terminal
from equivcheck.cli import main
from equivcheck.render.html import PLOTS_MISSING, render_html, run_metadata
from equivcheck.render.progress import Progress

FAILING = ["run", "--case", "mlp", "--case", "naive_scaling_uneven_chunks", "--regime", "accumulate:chunks=5",
           "--regime", "naive_accumulate:chunks=5"]


class Parsed(html.parser.HTMLParser):
    """The parts of an HTML report a test reads: headings, table cells (with their class), svg count."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.headings, self.cells, self.svgs, self.paragraphs, self._in = [], [], 0, [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg":
            self.svgs += 1
        if tag in ("h1", "h2", "h3", "td", "p"):
            self._in = (tag, attrs.get("class"))
            if tag == "td":
                self.cells.append([attrs.get("class"), ""])

    def handle_endtag(self, tag):
        self._in = None if self._in and self._in[0] == tag else self._in

    def handle_data(self, data):
        if not self._in:
            return
        tag = self._in[0]
        if tag == "td":
            self.cells[-1][1] += data
        elif tag == "p":
            self.paragraphs.append(data)
        else:
            self.headings.append(data)


@pytest.fixture(scope="module")
def failing_rows():
    return to_rows(ec.check_all(["mlp", "naive_scaling_uneven_chunks"],
                                       ["accumulate:chunks=5", "naive_accumulate:chunks=5"]))


def test_the_overview_is_one_line_per_case_and_fits_the_width():
    long_rows = [{"case": "a_case_with_a_long_name", "regime": f"naive_accumulate:chunks={k}", "verdict": "expected_mismatch",
                  "margin": 1e5, "problems": []} for k in range(2, 30)]
    text = render.render_overview(long_rows, width=80)
    lines = text.splitlines()
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines) and lines[2].endswith("...")
    assert lines[2].split()[:3] == ["a_case_with_a_long_name", "28", "caught"]


def test_what_is_not_as_expected_leads_its_case_and_is_red_on_a_terminal(failing_rows):
    plain = render.render_overview(failing_rows)
    mlp = next(line for line in plain.splitlines() if line.startswith("mlp "))
    assert "MISMATCH naive_accumulate:chunks=5 4e+05" in mlp
    coloured = render.render_overview(failing_rows, colour=True)
    assert f"{render.RED}mlp " in coloured and f"{render.RED}naive_scaling" not in coloured
    assert render.RED not in plain


def test_on_a_terminal_without_rich_the_overview_is_the_plain_columns(failing_rows, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich raises ImportError
    assert terminal.render_overview(failing_rows, 120, colour=True) == render.render_overview(failing_rows, colour=True)


def test_with_rich_long_cells_wrap_to_the_width_and_what_failed_is_red(failing_rows):
    pytest.importorskip("rich", reason="the terminal extra (make test-frameworks installs it)")
    long_rows = [{"case": "a_case_with_a_long_name", "regime": f"naive_accumulate:chunks={k}", "verdict": "expected_mismatch",
                  "margin": 1e5, "problems": []} for k in range(2, 30)]
    lines = terminal.render_overview(long_rows, 80, colour=False).splitlines()
    assert all(len(line) <= 80 for line in lines) and len(lines) > 4  # wrapped, not cut
    assert "naive_accumulate:chunks=29" in "".join(line.strip() for line in lines)
    coloured = terminal.render_overview(failing_rows, 120, colour=True)
    mlp = next(line for line in coloured.splitlines() if "mlp" in line)
    naive = next(line for line in coloured.splitlines() if "naive_scaling" in line)
    assert "\x1b[31m" in mlp and "\x1b[31m" not in naive
    assert "\x1b[" not in terminal.render_overview(failing_rows, 120, colour=False)


def test_markdown_says_the_status_and_each_failure_with_its_hint(tmp_path, capsys, locating):
    path = tmp_path / "summary.md"
    assert main([*FAILING, "--markdown", str(path)]) == 1
    text = path.read_text()
    assert text.startswith("## equivcheck: not as expected\n")
    assert "| mlp | 1 ok, 1 MISMATCH | MISMATCH naive_accumulate:chunks=5 4e+05 |" in text
    assert ("- **mlp** under `naive_accumulate:chunks=5`: mismatch 4e+05; parts at step 0, loss (the gradient of the "
            "loss with respect to the model's output differs") in text
    assert "; the step-0 loss already differs" in text
    assert main(["run", "--case", "mlp", "--regime", "accumulate:chunks=5", "--markdown", str(path)]) == 0
    assert path.read_text().startswith("## equivcheck: ok\n") and "Not as expected" not in path.read_text()
    capsys.readouterr()


def test_the_html_report_holds_the_matrix_the_failures_and_their_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plots need the report extra (make test-frameworks installs it)")
    path = tmp_path / "report.html"
    assert main([*FAILING, "--html", str(path)]) == 1
    capsys.readouterr()
    page = Parsed(path.read_text())
    assert "not as expected" in page.headings
    assert ["bad", "MISMATCH 4e+05"] in page.cells and ["caught", "caught 4e+05"] in page.cells
    # a faithful row's margin is rounding, which the CPU's kernels set (5e-10 on one machine, 1e-09 on another)
    assert any(cls == "ok" and re.fullmatch(r"ok \d(\.\d+)?e-(09|10)", text) for cls, text in page.cells)
    assert "mlp under naive_accumulate:chunks=5: mismatch" in "".join(page.headings)
    assert page.svgs == 1  # one failing check, one divergence plot
    assert PLOTS_MISSING not in page.paragraphs


def test_without_matplotlib_the_report_keeps_its_tables_and_says_how_to_get_plots(failing_rows, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    page = Parsed(render_html(failing_rows, run_metadata(seed=0, dtype=None, backend=None, world_sizes=[1])))
    assert page.svgs == 0 and PLOTS_MISSING in page.paragraphs
    assert ["bad", "MISMATCH 4e+05"] in page.cells
    assert any(cell == [None, "grad 0.weight"] for cell in page.cells)
    assert [None, "torch"] in page.cells


METADATA = {"equivcheck": "test"}


def wide(rows: list[dict]) -> list[dict]:
    """``rows`` and 14 more regimes with long specs: a matrix wider than any page."""
    return rows + [dict(rows[0], regime=f"ddp_step:world_size=2,fn=team_module:train_step_variant_{k}")
                   for k in range(14)]


def test_the_matrix_scrolls_in_its_own_box_keeping_the_case_column_in_view(failing_rows):
    page = render_html(wide(failing_rows), METADATA)
    assert "<div class='scroll'><table class='matrix'>" in page
    assert "table.matrix th:first-child, table.matrix td:first-child { position: sticky; left: 0;" in page
    assert "<th>ddp_step:<wbr>world_size=2,<wbr>fn=team_module:<wbr>train_step_variant_0</th>" in page  # may wrap


def test_plots_all_draws_the_caught_pitfalls_too(failing_rows, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plots need the report extra (make test-frameworks installs it)")
    failures, everything = (Parsed(render_html(failing_rows, METADATA, plots)) for plots in ("failures", "all"))
    caught = [r for r in failing_rows if r["verdict"] == "expected_mismatch"]
    assert caught and "Caught pitfalls" in everything.headings and "Caught pitfalls" not in failures.headings
    assert everything.svgs == failures.svgs + len(caught)
    path = tmp_path / "report.html"
    assert main([*FAILING, "--html", str(path), "--plots", "all"]) == 1
    assert Parsed(path.read_text()).svgs == 2  # the mismatch and the caught pitfall
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([*FAILING, "--plots", "some"])
    assert exited.value.code == 2
    assert "argument --plots: invalid choice: 'some' (choose from 'failures', 'all')" in capsys.readouterr().err


MEASURE = """<script>
const box = document.querySelector("table.matrix").parentElement;
box.scrollLeft = 400;
const cell = document.querySelector("table.matrix td");
document.body.dataset.pageWidth = document.documentElement.scrollWidth;
document.body.dataset.scrolled = box.scrollLeft;
document.body.dataset.caseLeft = Math.round(cell.getBoundingClientRect().left - box.getBoundingClientRect().left);
</script></body>"""


def test_in_a_browser_1280_pixels_wide_the_page_never_scrolls_sideways(failing_rows, tmp_path):
    """Laid out by a real headless browser: the page is no wider than the window, the matrix scrolls inside its box,
    and its case column stays at the box's left edge when it does."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no headless browser here (Debian's chromium package): the layout is asserted by its structure")
    path = tmp_path / "report.html"
    path.write_text(render_html(wide(failing_rows), METADATA).replace("</body>", MEASURE))
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                           "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    body = re.search(r"<body ([^>]*)>", done.stdout).group(1)
    measured = dict(re.findall(r'data-([a-z-]+)="(\d+)"', body))
    assert int(measured["page-width"]) <= 1280
    assert int(measured["scrolled"]) > 0  # wider than the page: it scrolls, inside its box
    assert measured["case-left"] == "0"  # sticky: the case column is still in view


def test_the_plugins_report_options_refuse_a_path_that_cannot_be_written(pytester):
    """What the plugin writes under ``-n 2`` is read in test_pytest_plugin.py's xdist test (one xdist session)."""
    bad = pytester.runpytest("--equivcheck-html=/no/such/folder/r.html")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad = pytester.runpytest("--equivcheck-markdown=/no/such/folder/s.md")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_on_a_terminal_only(monkeypatch):
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    monkeypatch.delenv("CI", raising=False)
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress(2, "checks", stream)
        progress.step("mlp accumulate:chunks=5")
        progress.close()
    assert "checks 1/2  mlp accumulate:chunks=5" in terminal.getvalue() and pipe.getvalue() == ""
    monkeypatch.setenv("CI", "true")
    quiet = Terminal()
    Progress(1, "checks", quiet).step("mlp")
    assert quiet.getvalue() == ""


def test_json_rows_carry_the_divergence_per_step(failing_rows):
    row = next(r for r in failing_rows if r["case"] == "mlp" and r["verdict"] == "mismatch")
    grads = [m for m in row["mismatches"] if m["kind"] == "grad"]
    assert grads and all(len(m["step_margins"]) == 3 and max(m["step_margins"]) == m["margin"] for m in grads)
    json.dumps(row)  # plain data
