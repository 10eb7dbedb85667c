"""The gate as users run it: ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` unset (as CI runners and laptops have them),
several in-process checks in one pytest session, one of them failing.

make test runs the whole suite so; whatever the suite's own environment, every process these tests start runs without
them. There the checking process trains and compares on torch's own thread count, so OpenMP's pool is live when the
next check forks its isolating child: a child that copies a tensor on that inherited pool waits for threads that did
not survive the fork, for ever (issue 64). Each process here has a limit, so that a hang fails its test.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.runners.isolation import IsolatedRunner
from equivcheck.runners.request import RunRequest

from processes import alive

USERS_ENVIRONMENT = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
PROCESS_LIMIT = 240  # seconds: each process here takes 5 to 30; a hang takes for ever

# Large enough that a tensor copy runs as an OpenMP parallel region (ATen's grain: 32,768 elements).
GATE_TESTS = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    import equivcheck as ec

    def make_model():
        return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))

    def make_data():
        g = torch.Generator().manual_seed(1)
        return torch.randn(96, 64, generator=g), torch.randint(0, 8, (96,), generator=g)

    def loss_per_item(out, target):
        return F.cross_entropy(out, target, reduction="none")

    CASE = ec.Case(name="gate", model=make_model, data=make_data, loss=loss_per_item, batch_size=32, steps=3)

    def accumulated(model, optimizer, batch):
        inputs, targets = batch
        optimizer.zero_grad()
        for x, y in zip(inputs.chunk(4), targets.chunk(4)):
            (F.cross_entropy(model(x), y, reduction="sum") / len(inputs)).backward()
        optimizer.step()

    def means_summed(model, optimizer, batch):  # each micro-batch's mean, summed: four times the gradient
        inputs, targets = batch
        optimizer.zero_grad()
        for x, y in zip(inputs.chunk(4), targets.chunk(4)):
            F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def test_first_passes(equivcheck):
        equivcheck.check_step(CASE, accumulated)

    def test_second_fails(equivcheck):
        equivcheck.check_step(CASE, means_summed)

    def test_third_passes(equivcheck):
        equivcheck.check_step(CASE, accumulated)
""")


def run_as_users(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=USERS_ENVIRONMENT, capture_output=True, text=True,
                          timeout=PROCESS_LIMIT)


@pytest.mark.parametrize("workers", [[], pytest.param(["-n", "2"], marks=pytest.mark.full_only)],
                         ids=["in-process", "xdist"])  # under xdist: make test-full
def test_three_checks_in_one_session_end_one_failed_two_passed(tmp_path, workers):
    (tmp_path / "test_gate.py").write_text(GATE_TESTS)
    done = run_as_users([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                         *workers, "test_gate.py"], tmp_path)
    assert "1 failed, 2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAILED test_gate.py::test_second_fails" in done.stdout


def test_the_command_checks_case_after_case_as_users_run_it(tmp_path):
    (tmp_path / "gate_cases.py").write_text(GATE_TESTS.split("def accumulated")[0] + textwrap.dedent("""
        ec.register_case(CASE)
        ec.register_case(ec.Case(name="gate_naive", model=make_model, data=make_data, loss=loss_per_item,
                                 batch_size=32, steps=3, regimes=["naive_accumulate:chunks=5"]))
    """))
    done = run_as_users([sys.executable, "-m", "equivcheck", "run", "--cases-from", "gate_cases.py",
                         "--case", "gate", "--case", "gate_naive", "--regime", "accumulate:chunks=4",
                         "--regime", "naive_accumulate:chunks=5", "--regime", "sample_by_sample"], tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # naive scaling, not declared: a mismatch
    verdicts = done.stdout.splitlines()[-2]
    assert "6 checks" in verdicts and "error" not in verdicts, done.stdout[-3000:]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 8))


WIDE = ec.Case(name="wide_after_parallel", model=_mlp, data=lambda: (torch.randn(32, 128), torch.randint(0, 8, (32,))),
               loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=16, steps=2)


def test_a_child_forked_after_a_parallel_region_trains_and_answers():
    """This process runs a parallel region on two threads, then forks: the child must answer (its copies of the
    result on one thread), not wait for the parent's pool. Fails (the run hangs, then times out) where the child
    keeps its parent's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).clone()  # a parallel region: the pool's threads are live now
        runner = IsolatedRunner([(WIDE, [ec.parse_regime("full_batch")])])
        request = RunRequest.of(WIDE, ec.parse_regime("full_batch"), seed=0, threads=1)
        result = runner.train(request, timeout=20)
        runner.close()
    finally:
        torch.set_num_threads(before)
    assert len(result.losses) == WIDE.steps


LONG = dataclasses.replace(WIDE, name="long_after_parallel", steps=5,
                           data=lambda: (torch.randn(80, 128), torch.randint(0, 8, (80,))))


def slow_mean_step(model, optimizer, batch):
    """A faithful step that takes its time: a run longer than its timeout that keeps stepping, as a real model's does."""
    time.sleep(0.5)
    inputs, targets = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_a_run_longer_than_its_timeout_that_keeps_stepping_is_judged_not_called_a_hang():
    """The timeout measures silence: five steps of half a second each under a 1.5 s timeout are a run, not a hang (a
    model at a real size, or torch.compile's first graphs on a loaded machine, take minutes that way)."""
    started = time.monotonic()
    (outcome,) = ec.check_step(LONG, slow_mean_step, isolate=True, timeout=1.5).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT, outcome.describe()
    assert time.monotonic() - started > 2.5  # it did outlast its timeout


HUNG_PID = []  # the file the hung step writes its process's id to, set by the test (a fork inherits it)


def hangs(model, optimizer, batch):
    """A team's step that never returns (the isolating child's kill ends it)."""
    with open(HUNG_PID[0], "w") as pid:
        pid.write(str(os.getpid()))
    time.sleep(3600)


def test_a_hung_child_is_an_error_with_its_stack_within_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "HUNG_PID", [tmp_path / "pid"])
    started = time.monotonic()
    report = ec.check_step(WIDE, hangs, isolate=True, timeout=3)
    took = time.monotonic() - started
    outcome = report.outcomes[-1]
    assert outcome.verdict is ec.Verdict.ERROR, outcome.describe()
    assert "made no progress for 3 s" in outcome.reason and "in hangs (test_as_users_run.py:" in outcome.reason, \
        outcome.reason
    assert "the isolating child's stack when it timed out" in outcome.details, outcome.details
    assert took < 3 + 20, took  # the timeout, the stack's second, the reference's runs
    assert not alive(int((tmp_path / "pid").read_text())), "the hung child outlived its verdict"
