"""Runs train with one intra-op thread unless the user chose a number, and the caller keeps its own."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.process import threads as intra_op


def full_batch_step(model, optimizer, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def insisting_on(threads):
    """A step that raises unless it trains with ``threads`` intra-op threads: seen wherever the run trains (a forked
    child, this process)."""
    def step(model, optimizer, batch):
        if torch.get_num_threads() != threads:
            raise RuntimeError(f"the step trains with {torch.get_num_threads()} threads, not {threads}")
        return full_batch_step(model, optimizer, batch)
    return step


@pytest.fixture
def torch_default(monkeypatch):
    """A caller whose environment chose nothing, with torch at the count it picked itself (here 2)."""
    for name in intra_op.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(intra_op, "AT_IMPORT", 2)
    yield 2
    torch.set_num_threads(before)


def test_by_default_a_run_uses_one_thread_and_gives_the_callers_back(torch_default):
    ec.check_step("mlp", insisting_on(1)).assert_equivalent()
    ec.check_step("mlp", insisting_on(1), isolate=True).assert_equivalent()  # in a forked child too
    assert torch.get_num_threads() == torch_default
    (other,) = ec.check_step("mlp", insisting_on(2)).outcomes  # the twin: a count the run does not use is seen
    assert other.verdict is ec.Verdict.ERROR and "trains with 1 threads, not 2" in other.reason


def test_a_large_model_in_this_process_trains_on_the_cores_other_tasks_leave_free(torch_default, monkeypatch):
    """A million parameters or more and nobody chose: the check's runs take torch's count less the busy cores. A busy
    machine, a forked child (pinned: OpenMP's pool does not survive the fork) and a small model keep one thread."""
    monkeypatch.setattr(intra_op, "WIDE_FROM", 100)  # mlp counts as large here
    monkeypatch.setattr(intra_op, "busy_cores", lambda: 0)
    ec.check_step("mlp", insisting_on(2)).assert_equivalent()
    ec.check_step("mlp", insisting_on(1), isolate=True).assert_equivalent()
    monkeypatch.setattr(intra_op, "busy_cores", lambda: 2)  # a busy neighbour on every core
    ec.check_step("mlp", insisting_on(1)).assert_equivalent()
    monkeypatch.setattr(intra_op, "WIDE_FROM", 10**9)
    monkeypatch.setattr(intra_op, "busy_cores", lambda: 0)
    ec.check_step("mlp", insisting_on(1)).assert_equivalent()
    ec.check_step("mlp", insisting_on(1), threads=1).assert_equivalent()  # a count chosen holds whatever the size
    assert torch.get_num_threads() == torch_default


def test_the_callers_count_comes_back_when_the_step_raises(torch_default):
    def failing(model, optimizer, batch):
        raise RuntimeError("the team's step broke")

    (outcome,) = ec.check_step("mlp", failing).outcomes
    assert outcome.verdict is ec.Verdict.ERROR and "the team's step broke" in outcome.reason
    assert torch.get_num_threads() == torch_default


@pytest.mark.parametrize("choose", ["environment", "set_num_threads", "argument"])
def test_a_users_choice_is_kept(torch_default, monkeypatch, choose):
    options = {}
    if choose == "environment":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    elif choose == "set_num_threads":
        torch.set_num_threads(3)
    else:
        options["threads"] = 3
    ec.check_step("mlp", insisting_on(2 if choose == "environment" else 3), **options).assert_equivalent()
    assert torch.get_num_threads() == (3 if choose == "set_num_threads" else torch_default)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_a_bad_thread_count_is_a_usage_error_before_anything_trains(threads):
    with pytest.raises(ec.InvalidArgument, match=f"threads={threads!r}"):
        ec.check("mlp", ["accumulate:chunks=2"], threads=threads)


def one_thread_ddp_step(model, optimizer, batch):
    """A rank's step that insists on one intra-op thread: an error verdict otherwise."""
    if torch.get_num_threads() != 1:
        raise RuntimeError(f"rank {dist.get_rank()} trains with {torch.get_num_threads()} threads")
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / 12
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return None


def test_the_ranks_train_with_the_count_the_parent_resolved(torch_default):
    ec.check_step("mlp", one_thread_ddp_step, world_size=2).assert_equivalent()
    (outcome,) = ec.check_step("mlp", one_thread_ddp_step, world_size=2, threads=2).outcomes
    assert outcome.verdict is ec.Verdict.ERROR and "trains with 2 threads" in outcome.reason


def test_the_cli_and_the_plugin_refuse_a_bad_count_as_usage_errors(pytester, capsys):
    from equivcheck.cli import main

    assert main(["run", "--case", "mlp", "--regime", "accumulate:chunks=2", "--threads", "0"]) == 2
    assert "threads=0 is not allowed" in capsys.readouterr().err
    result = pytester.runpytest("--equivcheck-threads=0", "--equivcheck-cases=mlp")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--equivcheck-threads=0 is not allowed: expected an integer >= 1*"])


def test_the_marker_sets_a_tests_count(pytester):
    pytester.makepyfile('''
import pytest, torch, torch.nn.functional as F

def step(model, optimizer, batch):
    assert torch.get_num_threads() == 2, torch.get_num_threads()
    inputs, targets = batch
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad()

@pytest.mark.equivcheck(threads=2)
def test_two(equivcheck):
    equivcheck.check_step("mlp", step)

def test_default_is_one(equivcheck):
    equivcheck.check_step("mlp", step)
''')
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_default_is_one*", "*AssertionError: 1*"])
