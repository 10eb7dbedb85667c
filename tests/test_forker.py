"""Ranks forked from the warm forker start as a fresh interpreter would: with the environment, import path,
working directory and standard streams their pool has when it starts, not those the forker had when it
started; and the forker itself forks from one thread and leaves with its parent."""

import os

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.runners.ranks import forker as forkers
from equivcheck.runners.ranks import pool as pools

CASE_MODULE = '''
import dataclasses, os
import equivcheck as ec

# A rank imports this module by name: it must find it on the import path, environment and folder given now.
assert os.environ.get("EQUIVCHECK_FORKER_PROBE") == "given after the forker started", os.environ.get(
    "EQUIVCHECK_FORKER_PROBE")
assert os.getcwd() == {cwd!r}, os.getcwd()
if "EQUIVCHECK_INSIDE_RANK" in os.environ:
    os.write(1, f"rank {{os.environ['EQUIVCHECK_INSIDE_RANK']}} imported the case\\n".encode())  # one write each
CASE = ec.register_case(dataclasses.replace(ec.get_case("mlp"), name="forker_probe", regimes=None))
'''


@pytest.fixture
def fresh_ranks(isolated_registry):
    """A warm forker and no warm pool: the next job's ranks are forked now. The test's cases stay its own."""
    pools.pool_for("gloo", 1)  # the forker runs from here on
    pools.shutdown_pools()
    yield
    pools.shutdown_pools()  # ranks forked with this test's environment serve no later test


def test_a_rank_takes_the_environment_path_folder_and_streams_its_pool_has_now(tmp_path, monkeypatch, capfd,
                                                                               fresh_ranks):
    modules, work = tmp_path / "modules", tmp_path / "work"
    modules.mkdir()
    work.mkdir()
    (modules / "forker_probe_case.py").write_text(CASE_MODULE.format(cwd=str(work)))
    monkeypatch.setenv("EQUIVCHECK_FORKER_PROBE", "given after the forker started")
    monkeypatch.syspath_prepend(str(modules))
    monkeypatch.chdir(work)
    import forker_probe_case

    outcome = ec.check(forker_probe_case.CASE, ["ddp:world_size=2"]).outcomes[0]
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    printed = capfd.readouterr().out  # the ranks print where this test's output is captured
    assert "rank 0 imported the case" in printed and "rank 1 imported the case" in printed


def test_an_answer_to_an_interrupted_fork_is_never_taken_for_the_next(monkeypatch, fresh_ranks):
    """Ctrl-C while the forker answers a fork: its answer arrives later, and the next pool must not take that
    (killed) rank for one of its own."""
    read, interrupted = forkers.Forker._read, []

    def interrupted_once_a_fork_is_asked(self, timeout):
        if not interrupted and self._requests:
            interrupted.append(self._requests)
            raise KeyboardInterrupt
        return read(self, timeout)

    monkeypatch.setattr(forkers.Forker, "_read", interrupted_once_a_fork_is_asked)
    with pytest.raises(KeyboardInterrupt):
        pools.pool_for("gloo", 2)
    monkeypatch.setattr(forkers.Forker, "_read", read)
    assert ec.check("mlp", ["ddp:world_size=2"]).outcomes[0].verdict is Verdict.EQUIVALENT
    assert all(code is None for code in (rank.poll() for rank in pools.pool_for("gloo", 2)._processes))


def test_the_forker_forks_from_one_thread_whatever_the_environment_asks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # numpy's BLAS would start a thread per core
    forker = forkers.Forker(60.0)
    try:
        forker._wait_until_ready()
        tasks = os.listdir(f"/proc/{forker._process.pid}/task")
    finally:
        forker.close()
    assert len(tasks) == 1, f"the forker runs {len(tasks)} threads: a fork would lose the others mid-work"


def test_an_interrupt_inside_a_message_from_the_forker_retires_it(monkeypatch, fresh_ranks):
    """Ctrl-C between reading a message's length and its body: the body would be read as the next message's
    length. That forker is stopped for good, and the next pool gets a new one."""
    interrupted = forkers.forker(60.0)
    assert interrupted.ready

    def half_read():
        interrupted._conn._recv(4)  # the length of the next message (the fork's answer), not its body
        raise KeyboardInterrupt

    monkeypatch.setattr(interrupted._conn, "recv", half_read)
    with pytest.raises(KeyboardInterrupt):
        pools.pool_for("gloo", 2)
    assert not interrupted.alive, "a forker whose channel stands inside a message was kept"
    assert ec.check("mlp", ["ddp:world_size=2"]).outcomes[0].verdict is Verdict.EQUIVALENT
    assert forkers.forker(60.0) is not interrupted


def test_an_interrupt_inside_a_request_to_the_forker_retires_it(monkeypatch, fresh_ranks):
    """Ctrl-C between a fork's request and the descriptors that go with it: the forker waits for them, and would
    take the next request's bytes for them. That forker is stopped for good."""
    interrupted = forkers.forker(60.0)
    assert interrupted.ready

    def interrupted_before_the_descriptors(*args):
        raise KeyboardInterrupt

    send_fds = forkers.socket.send_fds
    monkeypatch.setattr(forkers.socket, "send_fds", interrupted_before_the_descriptors)
    with pytest.raises(KeyboardInterrupt):
        pools.pool_for("gloo", 2)
    monkeypatch.setattr(forkers.socket, "send_fds", send_fds)
    assert not interrupted.alive, "a forker left waiting inside a request was kept"
    assert ec.check("mlp", ["ddp:world_size=2"]).outcomes[0].verdict is Verdict.EQUIVALENT


def test_a_processs_first_job_is_sent_once_the_forker_is_ready_and_the_reference_runs_meanwhile(monkeypatch,
                                                                                                 fresh_ranks):
    from equivcheck.check import iter_outcomes, plan

    monkeypatch.setattr(forkers.Forker, "ready", property(lambda self: False))  # as in a fresh process
    outcomes = iter_outcomes(plan("mlp", ["accumulate:chunks=2", "ddp:world_size=2"]))
    assert next(outcomes).verdict is Verdict.EQUIVALENT  # the reference and accumulate ran here meanwhile
    assert ("gloo", 2) not in pools._pools, "the job waited for the forker before this process did any work"
    (ddp,) = outcomes
    assert ddp.regime == "ddp:world_size=2" and ddp.verdict is Verdict.EQUIVALENT, ddp.describe()

    pools.shutdown_pools()
    abandoned = iter_outcomes(plan("mlp", ["accumulate:chunks=2", "ddp:world_size=2"]))
    next(abandoned)
    abandoned.close()  # Ctrl-C before the job was sent: there is no pool to close
    assert ("gloo", 2) not in pools._pools
