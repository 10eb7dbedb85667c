"""Faults injected into distributed checks: interruptions, signals, stale replies, runaway imports.

After each one: no stale verdict (the next check is judged on its own results, and a buggy regime
checked next is still caught), no process and no folder left behind, finished results kept.
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.runners.ranks import capacity
from equivcheck.runners.ranks import forker as forkers
from equivcheck.runners.ranks import pool as pools
from equivcheck.runners.ranks.jobs import TrainJob
from equivcheck.runners.request import RunRequest

import fault_cases  # noqa: F401  (registers the fault_* cases; workers import it by name)
from processes import alive

FAULT_CASES = str(Path(fault_cases.__file__))


def ranks_of(parent: int) -> set[int]:
    """The live worker ranks of process ``parent``'s pools: each keeps a file open in its pool's folder (where it
    dumps its stack), and the folder's name says whose pool it is."""
    marker = os.path.join(tempfile.gettempdir(), f"{pools.FOLDER_PREFIX}{parent}-")
    found = set()
    for fds in glob.glob("/proc/[0-9]*/fd"):
        pid = int(fds.split("/")[2])
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        if any(link.startswith(marker) for link in links_of(fds, names)) and alive(pid):
            found.add(pid)
    return found


def links_of(fds: str, names: list[str]) -> list[str]:
    links = []
    for name in names:
        try:
            links.append(os.readlink(os.path.join(fds, name)))
        except OSError:  # closed since it was listed
            pass
    return links


def folders_of(parent: int) -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"{pools.FOLDER_PREFIX}{parent}-*")))


def eventually(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def assert_a_buggy_regime_is_still_caught() -> None:
    """A stale reply would answer this job with another regime's result; a fresh one is judged on its own."""
    result = ec.run("ddp_mean_loss_uneven_tokens", "ddp_mean_loss:world_size=2")
    assert (result.case, result.regime) == ("ddp_mean_loss_uneven_tokens", "ddp_mean_loss:world_size=2")
    outcome = ec.check("ddp_mean_loss_uneven_tokens", ["ddp_mean_loss:world_size=2"]).outcomes[0]
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH, outcome.describe()


class SignalTimeout(Exception):
    """What a per-test timeout raises from its signal handler (pytest-timeout's signal method does this)."""


@pytest.fixture
def alarm():
    """Raise ``exception`` in the main thread after ``seconds``, as Ctrl-C or a timeout's signal handler would."""
    def arm(seconds: float, exception: type[BaseException]) -> None:
        def fire(signum, frame):
            raise exception("injected")

        signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    previous = signal.getsignal(signal.SIGALRM)
    yield arm
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("exception", [KeyboardInterrupt, SignalTimeout])
def test_an_interrupted_job_closes_its_pool_and_the_next_job_gets_its_own_results(alarm, exception):
    warm = pools.pool_for("gloo", 2)
    ranks = set(warm.pids)
    alarm(1.5, exception)  # the slow job takes 3 s: its replies would still be on their way
    with pytest.raises(exception):
        ec.run("fault_slow", "ddp:world_size=2")
    assert not warm.alive and pools._pools.get(("gloo", 2)) is not warm
    assert eventually(lambda: not ranks & ranks_of(os.getpid())), "a rank of the interrupted pool lives on"
    assert_a_buggy_regime_is_still_caught()


def test_a_reply_to_another_job_is_a_protocol_error_never_a_result():
    warm = pools.pool_for("gloo", 2)
    job = TrainJob.of(RunRequest.of("mlp", "ddp:world_size=2"), "equivcheck_cases.mlp")
    for conn in warm._conns:  # a job whose replies nobody read, as if its reader had been interrupted
        conn.send((99, job))
    with pytest.raises(ec.WorkerError, match=r"rank \d answered job 99 while job \d+ was waiting"):
        warm.run(job)
    assert not warm.alive
    assert_a_buggy_regime_is_still_caught()


def test_an_interrupt_while_the_forker_starts_leaves_no_rank_and_no_folder(alarm):
    me = os.getpid()
    pools.shutdown_pools()  # a warm pool of 3 ranks, from a test before, would be handed back without starting
    forkers.shutdown_forker()
    alarm(0.5, KeyboardInterrupt)  # the new forker is still importing torch: no rank was asked for
    with pytest.raises(KeyboardInterrupt):
        pools.pool_for("gloo", 3)
    assert ("gloo", 3) not in pools._pools
    assert not ranks_of(me) and not folders_of(me)
    assert_a_buggy_regime_is_still_caught()


def test_an_interrupt_between_a_fork_and_its_pid_reaching_the_pool_leaves_no_rank(monkeypatch):
    """The narrowest window: the forker has forked a rank and the interrupt lands before the pool holds its pid.
    The first rank waits in the rendezvous for the others; neither may live on."""
    me = os.getpid()
    ranks_before, folders_before = ranks_of(me), folders_of(me)
    spawn, spawned = forkers.Forker.spawn, []

    def interrupted_after_the_second_fork(self, *args, **kwargs):
        rank = spawn(self, *args, **kwargs)
        spawned.append(rank.pid)
        if len(spawned) == 2:
            raise KeyboardInterrupt
        return rank

    pools.shutdown_pools()  # a warm pool of 3 ranks, from a test before, would be handed back without a fork
    monkeypatch.setattr(forkers.Forker, "spawn", interrupted_after_the_second_fork)
    with pytest.raises(KeyboardInterrupt):
        pools.pool_for("gloo", 3)
    monkeypatch.undo()
    assert len(spawned) == 2 and ("gloo", 3) not in pools._pools
    assert eventually(lambda: ranks_of(me) <= ranks_before), "a rank of the interrupted start lives on"
    assert not any(alive(pid) for pid in spawned) and folders_of(me) <= folders_before
    assert_a_buggy_regime_is_still_caught()


@pytest.mark.parametrize(("fault", "code", "name"),
                         [("sigint", 130, "SIGINT"),  # make test: the Ctrl-C; make test-full: the other two too
                          pytest.param("sigterm", 143, "SIGTERM", marks=pytest.mark.full_only),
                          # the second Ctrl-C lands while the CLI stops its pool
                          pytest.param("sigint_twice", 130, "SIGINT", marks=pytest.mark.full_only)])
def test_the_cli_keeps_finished_verdicts_when_interrupted(tmp_path, fault, code, name):
    out = tmp_path / "rows.json"
    cli = subprocess.Popen(
        [sys.executable, "-m", "equivcheck", "run", "--cases-from", FAULT_CASES, "--case", "mlp",
         "--case", f"fault_{fault}", "--regime", "accumulate:chunks=2", "--regime", "ddp:world_size=2",
         "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        start_new_session=True,  # its own process group, as a command typed at a terminal has
    )
    stdout, stderr = cli.communicate(timeout=240)
    assert cli.returncode == code, stdout + stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and document["status"] == "interrupted"
    # The fault case's DDP job starts on its ranks while its reference runs here, so its in-process verdict
    # may or may not be finished when the signal lands; every verdict finished is kept.
    rows = [(r["case"], r["regime"], r["verdict"]) for r in document["rows"]]
    assert rows == [("mlp", "accumulate:chunks=2", "equivalent"), ("mlp", "ddp:world_size=2", "equivalent"),
                    (f"fault_{fault}", "accumulate:chunks=2", "equivalent")][: len(rows)] and len(rows) >= 2
    assert f"{len(rows)} checks: {len(rows)} equivalent; interrupted by {name}" in stdout
    assert not ranks_of(cli.pid) and not folders_of(cli.pid)


RUNAWAY = """
import equivcheck as ec
from equivcheck_cases.mlp import mlp

CASE = ec.register_case(__import__("dataclasses").replace(mlp, name="unguarded"))
ec.check(CASE, ["ddp:world_size=2"]).assert_equivalent()   # no `if __name__ == "__main__":` guard
"""


def test_a_check_at_import_time_is_a_usage_error_in_the_parent_not_a_runaway(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(RUNAWAY)
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    most = 0

    def count() -> None:  # every process descended from the script, sampled while it runs
        nonlocal most
        while run.poll() is None:
            most = max(most, len(descendants(run.pid)))
            time.sleep(0.02)

    counter = threading.Thread(target=count)
    counter.start()
    stdout, stderr = run.communicate(timeout=120)
    counter.join()
    assert run.returncode == 1
    assert "InvalidArgument" in stderr and 'if __name__ == "__main__":' in stderr and "worker rank" in stderr
    assert 1 <= most <= 3, f"{most} processes descended from the script: at most the forker and 2 ranks, ever"
    assert not ranks_of(run.pid) and not folders_of(run.pid)


def descendants(root: int) -> set[int]:
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.split("/")[2])] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_the_pool_listens_on_loopback_only(monkeypatch):
    outside = sorted(set(os.listdir("/sys/class/net")) - {"lo"})
    if outside:  # the user's environment points gloo at an outside interface: the pool must not follow it
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", outside[0])
    pool = pools.WorkerPool("gloo", 2)
    try:
        listening = listening_addresses(pool.pids)
    finally:
        pool.close()
    assert listening, "gloo's ranks listen on no TCP socket: this test no longer sees where they listen"
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert set(listening) <= loopback, f"a rank listens beyond loopback: {listening}"


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets ``pids`` listen on."""
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for pid in pids for fd in os.listdir(f"/proc/{pid}/fd")]
    inodes = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, a socket of a rank
                    listening.append(fields[1].split(":")[0])
    return listening


def test_a_world_size_the_machine_cannot_hold_is_refused_with_numbers(monkeypatch):
    monkeypatch.setattr(capacity, "available_bytes", lambda: 2**30)  # a machine with 1 GiB left
    outcome = ec.check("mlp", ["ddp:world_size=9"]).outcomes[0]
    assert outcome.verdict is Verdict.SKIPPED
    assert "world_size=9 needs about 9 x" in outcome.reason and "1.0 GiB available" in outcome.reason
    assert ("gloo", 9) not in pools._pools


def test_a_distributed_run_trains_while_the_reference_runs_and_an_abandoned_one_closes_its_pool():
    """The first DDP job goes to its ranks before the reference runs here; a consumer that stops while it
    is in flight (Ctrl-C in the CLI) closes that pool, and the next check gets a fresh pool and its own results."""
    from equivcheck.check import iter_outcomes, plan

    pools.pool_for("gloo", 2)  # the forker ready: a process's very first job waits for it (tests/test_forker.py)
    outcomes = iter_outcomes(plan("mlp", ["accumulate:chunks=2", "ddp:world_size=2"]))
    first = next(outcomes)
    assert first.regime == "accumulate:chunks=2"
    pool = pools._pools[("gloo", 2)]
    assert pool._in_flight is not None  # sent before the reference ran, not yet collected
    outcomes.close()
    assert not pool.alive and ("gloo", 2) not in pools._pools
    (fresh,) = ec.check("mlp", ["ddp:world_size=2"]).outcomes
    assert fresh.verdict is Verdict.EQUIVALENT
    assert_a_buggy_regime_is_still_caught()


def test_a_pool_never_holds_two_jobs_in_flight():
    pool = pools.pool_for("gloo", 2)
    job = TrainJob.of(RunRequest.of("mlp", "ddp:world_size=2", threads=1), "equivcheck_cases.mlp")
    ticket = pool.submit(job)
    with pytest.raises(ec.WorkerError, match=f"job {ticket.number} is still in flight: collect it before the next"):
        pool.submit(job)
    assert len(pool.collect(ticket)) == 2 and pool.alive


def test_a_signal_that_lands_in_a_finalizer_still_stops_the_command(monkeypatch):
    """Python runs a signal handler inside ``__del__`` too, where a raised exception is printed and dropped:
    the CLI's handler sends the signal again once the finalizer is done, so the stop is neither lost nor noisy."""
    from equivcheck.cli import _sigterm_interrupts
    from equivcheck.errors import Interrupted

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, inside the finalizer

    with pytest.raises(Interrupted, match="SIGTERM"), _sigterm_interrupts():
        Finalized()  # its finalizer runs at once
        time.sleep(5)  # the signal, sent again, stops this
    assert dropped == []


def test_a_second_stop_signal_while_the_command_stops_changes_nothing():
    """An impatient second Ctrl-C (or SIGTERM after it) while the CLI keeps what finished and stops its ranks would
    break that stop off halfway: it is ignored until the command is done; the next command stops again."""
    from equivcheck.cli import _sigterm_interrupts
    from equivcheck.errors import Interrupted

    with _sigterm_interrupts():
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        try:
            signal.raise_signal(signal.SIGINT)  # the command is stopping: nothing is raised
            signal.raise_signal(signal.SIGTERM)
        except (KeyboardInterrupt, Interrupted) as stop:
            pytest.fail(f"a second stop signal broke off the stop: {stop!r}")
    with pytest.raises(KeyboardInterrupt), _sigterm_interrupts():
        signal.raise_signal(signal.SIGINT)


SIGNAL_AT_EXIT = """
import atexit, os, signal, sys
from equivcheck import cli
atexit.register(os.kill, os.getpid(), signal.SIGINT)  # a Ctrl-C while the exit handlers stop the ranks
sys.argv = ["equivcheck", "list"]
cli.entry()
"""


def test_a_signal_while_the_command_exits_leaves_no_traceback():
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, \
        done.stderr


class ClosedPipe:
    """The parent's end, closed: what a rank meets when the CLI was stopped by SIGTERM mid-job."""

    def send(self, message):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_rank_whose_parent_stopped_listening_leaves_quietly():
    """A broken pipe while replying ends the rank's loop; a traceback of it would land on the user's terminal."""
    from equivcheck.runners.ranks.worker import reply

    assert reply(ClosedPipe(), 3, lambda: {"result": 1}) is False
    assert reply(ClosedPipe(), 3, lambda: 1 / 0) is False  # the error reply meets the same closed pipe
    sent = []
    pipe = type("Pipe", (), {"send": staticmethod(sent.append)})()
    assert reply(pipe, 4, lambda: 1 / 0) is True
    assert sent[0][:2] == (4, "error") and "ZeroDivisionError" in sent[0][2]


def test_a_pool_removes_the_folders_of_pools_whose_process_is_gone(tmp_path):
    """A parent killed with its ranks leaves its folder; the next pool start removes it, never a live one's."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tempfile.mkdtemp(prefix=f"{pools.FOLDER_PREFIX}{gone.pid}-")
    live = tempfile.mkdtemp(prefix=f"{pools.FOLDER_PREFIX}{os.getppid()}-")  # a running process's
    try:
        pools.remove_orphaned_folders()
        assert not os.path.exists(orphan) and os.path.isdir(live)
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(orphan, ignore_errors=True)
