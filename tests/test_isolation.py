"""A run that kills its process is a verdict: SIGSEGV, SIGILL or os._exit inside a forward becomes an ``error``
naming how the run ended, in process, on ranks, from the CLI, the catalogue and the plugin, and every other
verdict is kept. And a CPU autocast precision whose kernels kill their process runs on a path that survives.

``crash_*`` (tests/fault_cases.py) kill their process in a forward over fewer samples than the global batch: the
full-batch reference trains, every split run dies. Each test here would take its pytest worker down with it if
the isolation were removed.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.runners import isolation
from equivcheck.runners.request import RunRequest
from equivcheck.process import kernels
from equivcheck.process.forking import fork_is_safe
from equivcheck.process.torch_imports import import_what_training_imports
from equivcheck.judge.verdict import Status
from equivcheck.check import isolated, iter_outcomes, plan
from equivcheck.suites.catalogue import Entry, run_catalogue
from equivcheck.errors import RunDied
from equivcheck.precision import registered_name, resolve_precision

import fault_cases
import faulty_kernels
from processes import alive

FAULT_CASES = str(Path(fault_cases.__file__))
CRASHES = [("crash_sigsegv", "killed by SIGSEGV"), ("crash_sigill", "killed by SIGILL"), ("crash_exit", "exit code 3")]


def children_of(parent: int) -> set[int]:
    """The live processes whose parent is ``parent``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and alive(int(stat.parent.name)):
            found.add(int(stat.parent.name))
    return found


@pytest.mark.parametrize("case, death", CRASHES)
def test_a_run_that_kills_its_process_is_an_error_naming_how_and_the_check_goes_on(case, death):
    report = ec.check(case, ["accumulate:chunks=3", "retained_graph:chunks=3", "sample_by_sample"], isolate=True)
    crashed, survived, crashed_again = report.outcomes
    assert crashed.verdict is Verdict.ERROR and death in crashed.reason
    if death.startswith("killed"):  # faulthandler's frames, innermost first: the forward that died
        assert "in forward (fault_cases.py:" in crashed.reason
        assert "Fatal Python error" in crashed.details and "fault_cases.py" in crashed.details
    assert survived.verdict is Verdict.EQUIVALENT  # one forward on the global batch: a fresh child trains it
    assert crashed_again.verdict is Verdict.ERROR and death in crashed_again.reason
    assert report.status is Status.ERROR


def test_a_reference_that_kills_its_process_makes_every_outcome_an_error():
    report = ec.check("crash_sigsegv", ["full_batch", "accumulate:chunks=2"], reference="sample_by_sample",
                      isolate=True)
    assert [o.verdict for o in report.outcomes] == [Verdict.ERROR, Verdict.ERROR]
    assert all("the reference sample_by_sample failed" in o.reason and "SIGSEGV" in o.reason for o in report.outcomes)


def test_a_lone_isolated_run_raises_run_died():
    with pytest.raises(RunDied, match="killed by SIGILL") as died:
        ec.run("crash_sigill", "accumulate:chunks=2", isolate=True)
    assert died.value.exit_code == -signal.SIGILL


def test_without_isolation_the_same_crash_kills_the_process():
    """The twin: what every test above would do to its pytest worker without the isolation (the library's default,
    where a check trains in the caller's process)."""
    script = f"import sys; sys.path.insert(0, {str(Path(FAULT_CASES).parent)!r}); import fault_cases, equivcheck as ec; " \
             "ec.check('crash_sigsegv', ['accumulate:chunks=3']); print('survived')"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGSEGV and "survived" not in run.stdout


def test_a_run_that_raises_keeps_its_type_and_traceback():
    """Through the child, a usage error is still a usage error and a skip a skip: only deaths become RunDied."""
    case = ec.Case(name="raises_inside", model=lambda: torch.nn.Linear(3, 2), loss=_raising_loss,
                   data=lambda: (torch.randn(8, 3), torch.randn(8, 2)), batch_size=4, steps=2)
    (outcome,) = ec.check(case, ["accumulate:chunks=2"], reference="accumulate:chunks=2", isolate=True).outcomes
    assert outcome.verdict is Verdict.ERROR
    assert outcome.reason.startswith("the reference accumulate:chunks=2 failed: ZeroDivisionError: planted")
    assert "_raising_loss" in outcome.details


def _raising_loss(output, target):
    raise ZeroDivisionError("planted")


def test_the_child_sees_this_process_as_it_is_now_and_leaves_nothing_behind():
    """A case defined here, a closure over a local: nothing is pickled. Afterwards no child is left."""
    scale = 3.0
    case = ec.Case(name="closure_case", model=lambda: torch.nn.Linear(3, 2),
                   data=lambda: (scale * torch.randn(12, 3), torch.randn(12, 2)),
                   loss=lambda out, target: ((out - target) ** 2).sum(dim=1), batch_size=6, steps=2)
    ec.check(case, ["accumulate:chunks=3"], isolate=True).assert_equivalent()
    isolation.wait_for_exited()
    assert not children_of(os.getpid()) - _forkers()


def _forkers() -> set[int]:
    """This process's long-lived helpers, none of them a run's child: the forker, started by earlier distributed tests
    in the same worker, and Inductor's pool of compile workers, which torch 2.11 forks once a test has compiled."""
    from equivcheck.runners.ranks import forker

    helpers = {forker._forker._process.pid} if forker._forker is not None and forker._forker.alive else set()
    for child in children_of(os.getpid()):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch/_inductor/compile_worker" in command:
            helpers.add(child)
    return helpers


@pytest.mark.skipif(not fork_is_safe(), reason="a forked child's interruption: on a machine with a GPU an isolated "
                    "run trains on a one-rank worker, which the interrupted-command tests below stop")
def test_an_interrupt_during_an_isolated_run_kills_its_child(monkeypatch):
    slow, full_batch = ec.get_case("fault_slow"), ec.parse_regime("full_batch")
    # The class the registered case builds: a test before may have registered it again from fault_cases.py by path.
    monkeypatch.setattr(type(slow.model()), "forward", lambda self, x: (time.sleep(1.0), self.linear(x))[1])
    runner = isolation.IsolatedRunner([(slow, [full_batch])])
    children = []

    def interrupt_inside_the_run(signum, frame) -> None:
        """Ctrl-C as the terminal sends it, raised here in the main thread while it waits for the child (a signal a
        helper thread sent could reach that thread instead, and the main thread's wait would not wake)."""
        if not (runner._child and runner._child.alive):
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # not forked yet: a little later
            return
        children.append(runner._child.pid)
        raise KeyboardInterrupt

    import_what_training_imports()  # before the timer: the child forks at once, and trains for 3 s
    previous = signal.signal(signal.SIGALRM, interrupt_inside_the_run)
    signal.setitimer(signal.ITIMER_REAL, 0.5)  # inside the run's first forward
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.train(RunRequest.of(slow, full_batch, threads=1))  # one thread: the run forks, whatever ran before
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert runner._child is None and children and not alive(children[0])


def test_a_ctrl_c_that_reaches_the_child_is_left_to_the_command():
    """The run's child ignores it, and so does a rank (a GPU machine's isolating child is a one-rank worker)."""
    for outcome in ec.check("interrupts_itself", ["accumulate:chunks=2", "ddp:world_size=2"], isolate=True).outcomes:
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


def test_a_crash_on_a_rank_is_an_error_and_the_pool_recovers():
    report = ec.check("crash_sigsegv", ["ddp:world_size=2", "accumulate:chunks=2"], isolate=True)
    ranked, local = report.outcomes
    assert ranked.verdict is Verdict.ERROR and "died (killed by SIGSEGV) in forward (fault_cases.py:" in ranked.reason
    assert "Fatal Python error" in ranked.details  # the frames the rank's faulthandler wrote as it died
    assert local.verdict is Verdict.ERROR and "killed by SIGSEGV" in local.reason
    ec.check("mlp", ["ddp:world_size=2"]).assert_equivalent()


def test_the_cli_keeps_every_verdict_and_writes_every_report(tmp_path):
    out = {kind: tmp_path / f"report.{kind}" for kind in ("json", "html", "md")}
    run = subprocess.run(
        [sys.executable, "-m", "equivcheck", "run", "--cases-from", FAULT_CASES, "--case", "crash_sigsegv",
         "--case", "mlp", "--regime", "full_batch", "--regime", "accumulate:chunks=3",
         "--json", str(out["json"]), "--html", str(out["html"]), "--markdown", str(out["md"])],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr
    rows = {(r["case"], r["regime"]): r for r in json.loads(out["json"].read_text())["rows"]}
    assert {k: r["verdict"] for k, r in rows.items()} == {
        ("crash_sigsegv", "full_batch"): "equivalent", ("crash_sigsegv", "accumulate:chunks=3"): "error",
        ("mlp", "full_batch"): "equivalent", ("mlp", "accumulate:chunks=3"): "equivalent"}
    assert "killed by SIGSEGV" in rows["crash_sigsegv", "accumulate:chunks=3"]["reason"]
    assert "killed by SIGSEGV" in out["html"].read_text() and "crash_sigsegv" in out["md"].read_text()


def test_the_catalogue_gives_error_rows_for_an_entry_that_kills_its_process():
    entry = Entry("planted crash", "crash_declared", "naive_accumulate:chunks=3", "accumulate:chunks=3")
    (row,) = run_catalogue(["float64"], [entry], isolate=True)
    assert row.pitfall.verdict is Verdict.ERROR and row.twin.verdict is Verdict.ERROR
    assert "killed by SIGSEGV" in row.pitfall.reason and "killed by SIGSEGV" in row.twin.reason


PLUGIN_TEST = """
def test_alongside(equivcheck):
    equivcheck.check("mlp", ["accumulate:chunks=2"])
"""


@pytest.mark.parametrize("workers", [[], pytest.param(["-n", "2"], marks=pytest.mark.full_only)])  # xdist: test-full
def test_the_plugin_reports_the_crash_and_runs_every_other_test(pytester, workers):
    pytester.makepyfile(test_alongside=PLUGIN_TEST)
    result = pytester.runpytest_subprocess(
        *workers, "-p", "no:cacheprovider", "--equivcheck-cases-from", FAULT_CASES, "--equivcheck-cases",
        "crash_sigill", "--equivcheck-regimes", "accumulate:chunks=3", "--equivcheck-regimes", "retained_graph:chunks=3",
        "test_alongside.py", timeout=300)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*crash_sigill under accumulate:chunks=3: error*killed by SIGILL*"])
    assert "node down" not in result.stdout.str()


def test_the_plugin_without_isolation_dies_with_the_run(pytester):
    """The twin: --equivcheck-no-isolate trains in the test's process, and the crash ends the session."""
    pytester.makepyfile(test_alongside=PLUGIN_TEST)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:faulthandler", "--equivcheck-no-isolate", "--equivcheck-cases-from",
        FAULT_CASES, "--equivcheck-cases", "crash_sigill", "--equivcheck-regimes", "accumulate:chunks=3",
        "test_alongside.py", timeout=300)
    assert result.ret == -signal.SIGILL


def test_the_marker_takes_isolate_as_a_bool(pytester):
    pytester.makepyfile(test_marked="""
import pytest

@pytest.mark.equivcheck(isolate="yes")
def test_marked(equivcheck):
    equivcheck.check("mlp", ["accumulate:chunks=2"])
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_marked.py", timeout=300)
    result.stderr.fnmatch_lines(["*@pytest.mark.equivcheck isolate='yes' is not allowed: expected True or False*"])


# --- the precision preflight ---------------------------------------------------------------------------------

@pytest.fixture
def fresh_decisions(monkeypatch):
    """No precision probed yet in this process; oneDNN's variable as it was, afterwards."""
    monkeypatch.setattr(kernels, "_decisions", {})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


@pytest.mark.parametrize("forked", [True, False], ids=["forked probe", "probe in a fresh interpreter"])
def test_the_isa_cap_is_chosen_where_it_survives(monkeypatch, fresh_decisions, forked):
    """Either way a probe goes (a fork of this process where it may fork one, else a fresh interpreter: a GPU
    machine), the faulting default is seen and the cap chosen."""
    monkeypatch.setattr(kernels, "fork_is_safe", lambda: forked)
    faulty_kernels.install("isa_capped", monkeypatch.setattr)
    (outcome,) = ec.check("mlp", ["accumulate:chunks=2"], dtype="bf16-autocast").outcomes
    assert outcome.verdict is Verdict.EQUIVALENT
    assert "bf16-autocast ran on kernel path onednn-avx512" in outcome.reason
    assert "default died (killed by SIGILL)" in outcome.reason
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"  # for this process's and its ranks' first kernel


def test_mkldnn_off_is_applied_to_the_runs_in_process_and_on_ranks(monkeypatch, fresh_decisions):
    faulty_kernels.install("mkldnn_off", monkeypatch.setattr)
    specs = ["accumulate:chunks=3", "ddp:world_size=2"]
    report = ec.check("mkldnn_faults", specs, dtype="bf16-autocast", isolate=True)
    for outcome in report.outcomes:
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
        assert "kernel path mkldnn-off" in outcome.reason and "onednn-avx512 died (killed by SIGILL)" in outcome.reason
    # the same runs on the default path die, in process and on the ranks: the preflight is what saves them
    monkeypatch.setattr(kernels, "_decisions", {"bf16-autocast": kernels.Decision("bf16-autocast", kernels.DEFAULT, ())})
    unprobed = ec.check("mkldnn_faults", specs, dtype="bf16-autocast", isolate=True).outcomes
    assert [o.verdict for o in unprobed] == [Verdict.ERROR, Verdict.ERROR]
    assert all("killed by SIGILL" in o.reason for o in unprobed)


def test_a_capped_isa_reaches_the_runs_child_and_ranks_started_before_it_was_chosen(monkeypatch, fresh_decisions):
    """One runner for a command's float64 and bf16 plans: its child, forked for the float64 runs, lacks the
    variable the bf16 probe chose, as do warm ranks; both are started afresh, so the bf16 runs are capped."""
    faulty_kernels.install("isa_capped", monkeypatch.setattr)
    specs = ["accumulate:chunks=3", "ddp:world_size=2"]
    plans = [plan("isa_faults", specs, dtype=dtype, isolate=True) for dtype in ("float64", "bf16-autocast")]
    runner = isolated(plans)
    try:
        outcomes = [o for p in plans for o in iter_outcomes(p, runner=runner)]
    finally:
        runner.close()
    assert [o.verdict for o in outcomes] == [Verdict.EQUIVALENT] * 4, [o.describe() for o in outcomes]
    assert all("kernel path onednn-avx512" in o.reason for o in outcomes[2:])


def test_the_path_crosses_to_the_ranks_by_name():
    precision = resolve_precision("bf16-autocast@mkldnn-off")
    assert precision.kernel_path is kernels.MKLDNN_OFF
    assert registered_name(precision) == "bf16-autocast@mkldnn-off"
    with pytest.raises(ec.InvalidArgument, match="unknown kernel path 'amx'"):
        resolve_precision("bf16-autocast@amx")


def test_a_precision_no_path_survives_is_skipped_with_the_signal_and_the_way_out(monkeypatch, fresh_decisions):
    faulty_kernels.install("never", monkeypatch.setattr)
    (outcome,) = ec.check("mlp", ["accumulate:chunks=2"], dtype="bf16-autocast").outcomes
    assert outcome.verdict is Verdict.SKIPPED
    assert "no kernel path survives here" in outcome.reason and "killed by SIGILL" in outcome.reason
    assert "check in float32" in outcome.reason
    assert ec.check("mlp", ["accumulate:chunks=2"]).ok  # float64 is not probed: it runs as ever


def test_a_hung_probe_is_a_path_that_does_not_work(monkeypatch, fresh_decisions):
    monkeypatch.setattr(kernels, "PROBE_SECONDS", 0.5)
    monkeypatch.setattr(kernels, "probe_kernels", lambda precision: __import__("time").sleep(30))
    assert kernels.probe(resolve_precision("bf16-autocast"), kernels.DEFAULT) == "hung past 0.5 s"
    assert not children_of(os.getpid()) - _forkers()


CATALOGUE_WITH_FAULTY_KERNELS = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    import faulty_kernels
    faulty_kernels.install("mkldnn_off")
    from equivcheck.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.full_only  # two commands, 16 s: make test-full (the path chosen: test_the_isa_cap_is_chosen_where_it_survives)
def test_the_catalogue_header_and_the_json_name_the_kernel_path(tmp_path):
    script = tmp_path / "faulty_kernels.py"
    script.write_text(CATALOGUE_WITH_FAULTY_KERNELS)
    run = subprocess.run([sys.executable, str(script), "catalogue", "--dtype", "bf16-autocast", "--case", "tp_mlp"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "kernels: bf16-autocast ran on kernel path mkldnn-off" in run.stdout
    rows = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(script), "run", "--case", "mlp", "--regime", "accumulate:chunks=2",
                          "--dtype", "bf16-autocast", "--json", str(rows)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    document = json.loads(rows.read_text())
    assert "kernel path mkldnn-off" in document["kernels"]["bf16-autocast"]
    assert "kernel path mkldnn-off" in document["rows"][0]["reason"]


def test_the_audit_command_reports_the_crash_as_not_run_and_exits_0(tmp_path):
    rows = tmp_path / "audit.json"
    run = subprocess.run([sys.executable, "-m", "equivcheck", "audit", "--cases-from", FAULT_CASES, "--case",
                          "crash_sigsegv", "--json", str(rows)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    findings = {row["pitfall"]: row for row in json.loads(rows.read_text())}
    dead = findings["zero_grad inside the accumulation loop"]
    assert dead["sensitivity"] == "not run" and "killed by SIGSEGV" in dead["evidence"]


@pytest.mark.parametrize(("fault", "code", "name"), [("sigint", 130, "SIGINT"), ("sigterm", 143, "SIGTERM")])
def test_a_command_interrupted_inside_an_isolated_run_stops_cleanly(tmp_path, fault, code, name):
    """Ctrl-C reaches the run's child too (one process group): it ignores it, and the command kills it; no
    traceback from either, every finished verdict kept, nothing left running."""
    out = tmp_path / "rows.json"
    cli = subprocess.Popen(
        [sys.executable, "-m", "equivcheck", "run", "--cases-from", FAULT_CASES, "--case", "mlp", "--case",
         f"interrupt_{fault}", "--regime", "full_batch", "--regime", "accumulate:chunks=2", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        start_new_session=True)  # its own process group, as a command typed at a terminal has
    stdout, stderr = cli.communicate(timeout=240)
    assert cli.returncode == code, stdout + stderr
    assert "Traceback" not in stderr + stdout
    document = json.loads(out.read_text())
    assert document["interrupted"] is True
    assert [(r["case"], r["regime"], r["verdict"]) for r in document["rows"]] == [
        ("mlp", "full_batch", "equivalent"), ("mlp", "accumulate:chunks=2", "equivalent"),
        (f"interrupt_{fault}", "full_batch", "equivalent")]
    with pytest.raises(ProcessLookupError):  # no process of the command's session is left: its child was killed
        os.killpg(cli.pid, 0)
