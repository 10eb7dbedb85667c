"""Results that survive whatever the run meets: files written whole or not at all and before the terminal report,
no silent exit 0 on a run that checked nothing, an exiting checked code told as such, helpers that never run a
file lying in the working directory, and a forker that is stopped or killed never holds or misnames a run."""

import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.render import text as render
from equivcheck.render.rows import to_rows
from equivcheck.judge.verdict import Status
from equivcheck.cli import main
from equivcheck.runners.ranks import forker as forkers
from equivcheck.runners.ranks import pool as pools
from equivcheck.process.import_paths import import_file
from equivcheck.render.files import write_whole
from processes import alive

SMALL_RUN = ["run", "--case", "mlp", "--regime", "accumulate:chunks=2"]


def whole_results(folder):
    """The three results files of a finished run, each complete."""
    rows = json.loads((folder / "out.json").read_text())["rows"]
    html, markdown = (folder / "out.html").read_text(), (folder / "out.md").read_text()
    assert html.rstrip().endswith("</html>") and markdown.startswith("## equivcheck")
    return rows


def test_a_reader_that_closes_the_pipe_loses_no_results_file(tmp_path):
    """`equivcheck run --json out.json --html out.html | head -3`: before, both files were left empty (0 bytes)."""
    process = subprocess.Popen([sys.executable, "-m", "equivcheck", *SMALL_RUN, "--json", "out.json", "--html",
                                "out.html", "--markdown", "out.md"], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the report's first line
    errors = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, errors
    assert "Traceback" not in errors
    assert [row["verdict"] for row in whole_results(tmp_path)] == ["equivalent"]


def test_ctrl_c_while_the_report_prints_keeps_every_file(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(render, "render_overview", interrupted)
    code = main([*SMALL_RUN, "--json", str(tmp_path / "out.json"), "--html", str(tmp_path / "out.html"),
                 "--markdown", str(tmp_path / "out.md")])
    assert code == 130 and "interrupted by SIGINT" in capsys.readouterr().err
    assert len(whole_results(tmp_path)) == 1


KILLED_WHILE_WRITING = """
import os, signal, sys
from equivcheck import cli

def killed(*args, **kwargs):  # the CI job is cancelled while the results are being written
    os.kill(os.getpid(), signal.SIGKILL)

cli.json_document = killed
cli.main(sys.argv[1:])
"""


def test_a_run_killed_while_writing_keeps_the_last_good_file(tmp_path):
    """Before, the file was truncated when the run began: a kill left the last good results empty."""
    out = tmp_path / "out.json"
    assert main([*SMALL_RUN, "--json", str(out)]) == 0
    good = out.read_bytes()
    (tmp_path / "killed.py").write_text(KILLED_WHILE_WRITING)
    done = subprocess.run([sys.executable, "killed.py", *SMALL_RUN, "--json", str(out)], cwd=tmp_path, timeout=120,
                          capture_output=True)
    assert done.returncode == -signal.SIGKILL
    assert out.read_bytes() == good


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_a_file_is_whole_or_the_one_before_it_whatever_step_the_write_dies_at(tmp_path, where):
    out = tmp_path / "out.json"
    out.write_text("the last good results\n")
    script = textwrap.dedent(f"""
        import io, os, signal, sys
        from equivcheck.render import files as results_file

        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        if {where!r} == "write":
            results_file.os.fdopen = lambda *a, **k: type("Dying", (io.StringIO,), {{"write": killed}})()
        else:
            setattr(results_file.os, {where!r}, killed)
        results_file.write_whole(sys.argv[1], "new results\\n" * 100_000)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(out)], timeout=120, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert out.read_text() == "the last good results\n"


def test_a_file_keeps_its_mode_and_a_link_keeps_pointing_where_it_did(tmp_path):
    target = tmp_path / "kept.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_whole(str(link), "new")
    assert link.is_symlink() and target.read_text() == "new" and (target.stat().st_mode & 0o777) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["kept.json", "link.json"]  # no temporary left beside them


def test_a_results_path_that_cannot_be_written_is_an_error_after_the_other_files(tmp_path, capsys):
    """`--html /dev/full`: before, a traceback, exit 1, and the other files lost."""
    code = main([*SMALL_RUN, "--json", str(tmp_path / "out.json"), "--html", "/dev/full",
                 "--markdown", str(tmp_path / "out.md")])
    captured = capsys.readouterr()
    assert code == 2
    assert "equivcheck: error: could not write /dev/full: No space left on device" in captured.err
    assert "Traceback" not in captured.err
    assert "1 checks: 1 equivalent; all as expected" in captured.out  # the report came first
    assert len(json.loads((tmp_path / "out.json").read_text())["rows"]) == 1
    assert (tmp_path / "out.md").read_text().startswith("## equivcheck: ok")


def test_the_plugins_results_files_are_whole_and_an_unwritable_one_fails_the_session(pytester):
    pytester.makepyfile(test_one="def test_mlp(equivcheck):\n    equivcheck.check('mlp', ['accumulate:chunks=2'])\n")
    result = pytester.runpytest("--equivcheck-json", "out.json", "--equivcheck-markdown", "/dev/full")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(["*ERROR: equivcheck: could not write /dev/full: No space left on device*"])
    assert [row["verdict"] for row in json.loads((pytester.path / "out.json").read_text())["rows"]] == ["equivalent"]


def test_a_run_with_no_check_planned_is_never_a_success():
    report = ec.check_all([])
    assert report.status is Status.NOTHING_CHECKED and not report.outcomes
    assert "nothing was checked: no check was planned" in render.render_summary(report, 0.0)


EXITS = '''
import sys
import equivcheck as ec
import dataclasses

def exiting_loss(output, target):
    sys.exit(0)  # the code checked gives up the way a script does

CASE = ec.register_case(dataclasses.replace(ec.get_case("mlp"), name="exits_in_loss", loss=exiting_loss,
                                            split=None, regimes=None))
'''


@pytest.fixture
def exiting_case(tmp_path, isolated_registry):
    (tmp_path / "exiting_case.py").write_text(EXITS)
    return import_file(str(tmp_path / "exiting_case.py")).CASE


@pytest.mark.parametrize("isolate", [True, False])
def test_sys_exit_in_the_code_checked_is_an_error_naming_it(exiting_case, isolate):
    """Isolated, it read "the run's process died (exit code 1)"; in process, it ended the whole check."""
    report = ec.check(exiting_case, ["accumulate:chunks=2", "ddp:world_size=2"], isolate=isolate)
    for outcome in report.outcomes:
        assert outcome.verdict is Verdict.ERROR
        assert "the code checked raised SystemExit(0) at " in outcome.reason
        assert "exiting_case.py:7 (in exiting_loss)" in outcome.reason


def test_an_optimizer_factory_that_returns_none_is_named():
    case = dataclasses.replace(ec.get_case("mlp"), name="no_optimizer", optimizer=lambda params: None)
    with pytest.raises(ec.InvalidArgument, match=r"optimizer=<function .*> of case 'no_optimizer' returned None "
                                                 r"\(type=NoneType\): expected an optimizer with step\(\)"):
        ec.check(case, ["accumulate:chunks=2"])


@pytest.mark.parametrize("name", ["red\x1b[31mname", "two\nlines", "tab\there"])
def test_a_case_name_with_control_characters_is_refused(name):
    with pytest.raises(ec.InvalidArgument, match="expected a non-empty string of printable characters"):
        dataclasses.replace(ec.get_case("mlp"), name=name)


def test_a_long_case_name_is_cut_in_the_tables_and_kept_whole_in_the_rows():
    name = "a" * 150 + "_middle_" + "z" * 150
    case = dataclasses.replace(ec.get_case("mlp"), name=name)
    report = ec.check(case, ["accumulate:chunks=2"])
    rows = to_rows(report)
    assert {row["case"] for row in rows} == {name}
    overview = render.render_overview(rows, width=120)
    assert render.shown(name) in overview and name not in overview
    assert len(render.shown(name)) == render.NAME_WIDTH
    assert overview.splitlines()[0].index("verdicts") == render.NAME_WIDTH + 2  # the columns stay on screen
    assert all(len(line) <= 120 for line in render.render_matrix(report).splitlines())


PLANTED = """
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"ran-in-{os.getpid()}"), "w").close()
raise ImportError("a module of the working directory, planted")
"""


def test_no_helper_runs_a_file_lying_in_the_working_directory(tmp_path):
    """torch imports opt_einsum where it finds one: before, the forker (`python -m`) found this one and ran it in
    itself and so in every rank, though the command never imports it."""
    (tmp_path / "opt_einsum.py").write_text(PLANTED)
    command = os.path.join(os.path.dirname(sys.executable), "equivcheck")
    done = subprocess.run([command, "run", "--case", "mlp", "--regime", "ddp:world_size=2", "--json", "out.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [row["verdict"] for row in json.loads((tmp_path / "out.json").read_text())["rows"]] == ["equivalent"]
    assert not glob.glob(str(tmp_path / "ran-in-*")), "a helper process ran the working directory's opt_einsum.py"


STOPS_ITS_FORKER = """
import os, signal, sys
import equivcheck as ec
from equivcheck.runners.ranks import forker

ec.check("mlp", ["ddp:world_size=2"]).assert_equivalent()
print(forker._forker._process.pid, flush=True)
os.kill(forker._forker._process.pid, signal.SIGSTOP)  # stopped: it answers nothing, and its ranks wait
"""


def test_a_stopped_forker_does_not_hold_the_exit():
    """Before, the process waited without bound at exit for the stopped forker to say its ranks had gone."""
    process = subprocess.Popen([sys.executable, "-c", STOPS_ITS_FORKER], stdout=subprocess.PIPE, text=True)
    forker_pid = int(process.stdout.readline())
    try:
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while alive(forker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(forker_pid), "the stopped forker outlived the process that started it"
    finally:
        for pid in (process.pid, forker_pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_forker_killed_during_a_job_is_named_as_the_cause():
    """Its ranks leave with it: before, the error read "rank 0 died (exit code 1)"."""
    import fault_cases  # noqa: F401  (fault_slow: every rank takes a second a step)

    ec.run("mlp", "ddp:world_size=2")  # a warm pool: the job below is in flight within a second
    forker = forkers.forker(pools.START_TIMEOUT)
    killer = threading.Timer(1.5, os.kill, (forker._process.pid, signal.SIGKILL))
    killer.start()
    try:
        (outcome,) = ec.check("fault_slow", ["ddp:world_size=2"]).outcomes
    finally:
        killer.join()
    assert outcome.verdict is Verdict.ERROR
    # Named as the cause whether the job learns it from a rank's closed pipe or from the forker's own: never a rank
    # that died with exit code 1.
    assert "the forker that starts" in outcome.reason and "killed by SIGKILL" in outcome.reason, outcome.reason
    assert "exit code 1" not in outcome.reason
    assert ec.check("mlp", ["ddp:world_size=2"]).outcomes[0].verdict is Verdict.EQUIVALENT  # a fresh forker


SWEEPS = """
import equivcheck as ec
ec.check("mlp", ["accumulate:chunks=2"]).assert_equivalent()  # in process alone: no pool starts
"""


def test_a_later_check_sweeps_what_a_killed_one_left_in_the_temporary_folder():
    """A check killed with its ranks (SIGKILL, an OOM kill) runs no cleanup; before, only a later pool swept."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = [tempfile.mkdtemp(prefix=f"{prefix}{gone.pid}-") for prefix in pools.ORPHANED_PREFIXES]
    mine = tempfile.mkdtemp(prefix=f"{pools.FOLDER_PREFIX}{os.getpid()}-")  # a running process keeps its own
    try:
        subprocess.run([sys.executable, "-c", SWEEPS], check=True, timeout=120)
        assert not [folder for folder in left if os.path.exists(folder)]
        assert os.path.isdir(mine)
    finally:
        for folder in (*left, mine):
            if os.path.isdir(folder):
                os.rmdir(folder)


def test_a_forker_whose_parent_stopped_listening_leaves_quietly():
    """A run that ends while its forker still imports torch (Ctrl-C early, a usage error met on the way): before,
    the forker's "ready" met a closed pipe and printed a BrokenPipeError traceback onto the shared terminal."""
    done = subprocess.run([sys.executable, "-c", "from equivcheck.runners.ranks import forker\n"
                                                 "forker.forker(60.0).close()"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == ""


def test_the_context_parallel_probe_runs_no_file_of_the_working_directory(tmp_path):
    """The cp probe is a `python -c` helper too: with the working directory first on its path, torch would import the
    planted opt_einsum.py there."""
    (tmp_path / "opt_einsum.py").write_text(PLANTED)
    checker = ("import sys; del sys.path[0]\n"  # the checking process itself does not look there, as the CLI does not
               "from equivcheck.regimes.context import probe\nprint(probe('cpu', 'float32').ran)")
    done = subprocess.run([sys.executable, "-c", checker],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not glob.glob(str(tmp_path / "ran-in-*")), "the probe ran the working directory's opt_einsum.py"
