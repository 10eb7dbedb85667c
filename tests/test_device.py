"""The device a check trains on, the one rule that places ranks, and children that can train on a GPU machine."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import equivcheck as ec
from equivcheck import device
from equivcheck.errors import IsolationWarning
from equivcheck.runners import isolation
from equivcheck.runners.ranks import pool

import device_cases

NO_CUDA = "device='cuda' needs a CUDA device and torch.cuda.is_available() is False here"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False here")
without_cuda = pytest.mark.skipif(CUDA, reason="shows what a machine without CUDA does")


def gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(("given", "resolved"), [(None, "cpu"), ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:0", "cuda"),
                                                 (torch.device("cuda"), "cuda"), (torch.device("cpu"), "cpu")])
def test_a_device_is_cpu_or_cuda(given, resolved):
    assert device.resolve_device(given) == resolved


@pytest.mark.parametrize(("given", "words"), [("gpu", "unknown device 'gpu'; known devices: cpu, cuda"), (3, "device=3"),
                                            ("cuda:1", "unknown device 'cuda:1'")])
def test_any_other_device_is_refused_naming_it(given, words):
    with pytest.raises(ec.InvalidArgument, match=words):
        ec.check("mlp", "accumulate:chunks=2", device=given)


@pytest.mark.parametrize(("world_size", "found", "backend", "note"), [
    (2, 2, "nccl", ""),
    (4, 2, "gloo", "device='cuda': 4 ranks need a GPU each and 2 are here: gloo ranks on the CPU"),
    (2, 1, "gloo", "device='cuda': 2 ranks need a GPU each and 1 is here: gloo ranks on the CPU"),
    (1, 0, "gloo", "device='cuda': 1 ranks need a GPU each and 0 are here: gloo ranks on the CPU"),
])
def test_ranks_of_a_cuda_check_take_a_gpu_each_or_train_over_gloo_on_the_cpu_saying_why(
        monkeypatch, world_size, found, backend, note):
    gpus(monkeypatch, found)
    placed = ec.parse_regime(f"ddp:world_size={world_size}").placement("cuda")
    assert (placed.backend, placed.note) == (backend, note)


@pytest.mark.parametrize("found", [0, 1, 8])
def test_ranks_of_a_cpu_check_train_over_gloo_whatever_gpus_the_machine_has(monkeypatch, found):
    gpus(monkeypatch, found)
    assert ec.parse_regime("ddp:world_size=1").placement("cpu") == device.RankPlacement("gloo")
    assert ec.parse_regime("ddp:world_size=2,backend=nccl").placement("cpu").backend == "nccl"  # named: kept


def test_a_pipeline_stays_on_gloo_and_says_so_on_a_cuda_check(monkeypatch):
    gpus(monkeypatch, 4)
    placed = ec.parse_regime("pipeline:stages=2,microbatches=2").placement("cuda")
    assert placed.backend == "gloo" and "run on the CPU over gloo only" in placed.note


@without_cuda
def test_without_cuda_a_cuda_check_is_skipped_naming_cuda():
    report = ec.check("mlp", ["accumulate:chunks=2", "ddp:world_size=2"], device="cuda")
    assert [o.verdict for o in report.outcomes] == [ec.Verdict.SKIPPED] * 2
    assert all(NO_CUDA in o.reason for o in report.outcomes)
    assert report.status is ec.Status.NOTHING_CHECKED


@without_cuda
def test_without_cuda_the_command_with_device_cuda_checks_nothing_and_says_so():
    done = subprocess.run([sys.executable, "-m", "equivcheck", "run", "--case", "mlp", "--regime", "accumulate:chunks=2",
                           "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stdout + done.stderr
    assert NO_CUDA in done.stdout


def test_a_check_on_the_cpu_runs_every_run_there():
    report = ec.check("mlp", ["accumulate:chunks=2"], device="cpu")
    assert report.ok and report.outcomes[0].verdict is ec.Verdict.EQUIVALENT


def test_fp16_autocast_is_defined_on_cuda_only_and_says_so_on_the_cpu():
    precision = ec.resolve_precision("fp16-autocast")
    assert precision.default_device == "cuda"
    assert "defined on cuda only, not device='cpu'" in precision.unavailable("cpu")


def trained_in(tmp_path, monkeypatch, **options) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process that built the case's model during an isolated check."""
    record = tmp_path / "trained_in"
    monkeypatch.setenv(device_cases.RECORD_VARIABLE, str(record))
    pool.shutdown_pools()  # ranks take the environment their pool starts with
    report = ec.check("trained_where", ["accumulate:chunks=2"], isolate=True, **options)
    assert report.ok, report.describe()
    pool.shutdown_pools()
    return [tuple(map(int, line.split())) for line in record.read_text().split("\n") if line]


@without_cuda
def test_on_a_machine_without_a_gpu_the_isolating_child_is_forked_from_this_process(tmp_path, monkeypatch):
    built = trained_in(tmp_path, monkeypatch)
    assert {parent for _, parent in built} == {os.getpid()}


def test_where_this_process_may_not_fork_a_trainer_the_child_comes_from_a_process_that_never_trained(
        tmp_path, monkeypatch):
    """A GPU machine, as far as the runner can tell: every run trains in a one-rank worker forked by the pool's forker,
    an interpreter that never ran backward, never in a fork of this process (which has trained)."""
    monkeypatch.setattr(isolation, "fork_is_safe", lambda: False)
    ec.check("mlp", ["accumulate:chunks=2"])  # this process runs backward first, as a user's other tests would
    built = trained_in(tmp_path, monkeypatch)
    assert built and all(pid != os.getpid() and parent != os.getpid() for pid, parent in built)
    from equivcheck.runners.ranks import forker

    assert {parent for _, parent in built} == {forker._forker._process.pid}


def test_a_run_that_cannot_cross_by_name_trains_here_with_a_warning_where_this_process_may_not_fork(monkeypatch):
    monkeypatch.setattr(isolation, "fork_is_safe", lambda: False)
    case = ec.Case(name="built_in_a_test", model=lambda: torch.nn.Linear(3, 2),
                   data=lambda: (torch.randn(12, 3), torch.randn(12, 2)),
                   loss=lambda out, target: ((out - target) ** 2).sum(dim=1), batch_size=6, steps=2)
    with pytest.warns(IsolationWarning, match="'built_in_a_test' under 'full_batch' cannot cross by name"):
        report = ec.check(case, ["accumulate:chunks=3"], isolate=True)
    assert report.ok


def test_a_case_registered_inside_a_test_trains_here_with_a_warning_where_this_process_may_not_fork(
        monkeypatch, isolated_registry):
    """Registered, but by a call inside a test: a clean child that imports its module by name never sees it (on the
    H200 the child answered 'unknown case'), so the run trains here, saying so; the module's own cases cross."""
    from equivcheck.registry import registered_on_import

    monkeypatch.setattr(isolation, "fork_is_safe", lambda: False)
    pool.start_forker()  # the clean child's forker exists before the registration, as after a user's earlier tests
    ec.register_case(dataclasses.replace(ec.get_case("mlp"), name="registered_in_a_test"))
    assert not registered_on_import(ec.get_case("registered_in_a_test"))
    assert registered_on_import(ec.get_case("mlp")) and registered_on_import(ec.get_case(device_cases.CASE_NAME))
    with pytest.warns(IsolationWarning, match="'registered_in_a_test' under 'full_batch' cannot cross by name"):
        report = ec.check("registered_in_a_test", ["accumulate:chunks=3"], isolate=True)
    assert report.ok, report.outcomes


def test_deterministic_kernels_on_cuda_only_and_settings_restored():
    before = torch.are_deterministic_algorithms_enabled()
    with device.deterministic("cpu"):
        assert torch.are_deterministic_algorithms_enabled() == before
    with device.deterministic("cuda"):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.are_deterministic_algorithms_enabled() == before


def test_a_kernel_torch_refuses_as_nondeterministic_is_a_nondeterministic_verdict(monkeypatch):
    """torch's own refusal (use_deterministic_algorithms) is named, never taken for a bug or an error."""
    case = ec.Case(name="refused_kernel", model=lambda: torch.nn.Linear(3, 2),
                   data=lambda: (torch.randn(12, 3), torch.randn(12, 2)),
                   loss=lambda out, target: ((out - target) ** 2).sum(dim=1), batch_size=6, steps=2)
    from equivcheck.regimes import local

    def refuse(self, *args, **kwargs):
        raise RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set "
                           "'torch.use_deterministic_algorithms(True)'")

    monkeypatch.setattr(local.Accumulate, "train_step", refuse)
    outcome = ec.check(case, ["accumulate:chunks=3"]).outcomes[0]
    assert outcome.verdict is ec.Verdict.NONDETERMINISTIC and "index_add_cuda_" in outcome.reason


@needs_cuda
@pytest.mark.parametrize("dtype", ["float64", "float32", "bf16-autocast", "fp16-autocast"])
def test_every_public_precision_checks_on_cuda_and_catches_the_naive_mean_there(dtype):
    """12 samples in 8 micro-batches of 2 and 1: the mean of micro-batch means weighs them wrong."""
    report = ec.check("mlp", ["accumulate:chunks=4", "naive_accumulate:chunks=8"], device="cuda", dtype=dtype)
    assert [o.verdict for o in report.outcomes] == [ec.Verdict.EQUIVALENT, ec.Verdict.MISMATCH], \
        [o.reason for o in report.outcomes]


@needs_cuda
def test_an_isolated_check_after_this_process_trained_on_a_gpu_machine():
    """The failure a GPU machine showed: a child forked after autograd ran here could not run backward."""
    model = torch.nn.Linear(3, 1)
    model(torch.randn(4, 3)).sum().backward()  # autograd's device threads start here
    for case in ("mlp", device_cases.CASE_NAME):
        assert ec.check(case, ["accumulate:chunks=2"], isolate=True).ok


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() > 1, reason="needs exactly one CUDA device")
def test_a_teams_step_on_more_ranks_than_gpus_trains_over_gloo_on_the_cpu_saying_so():
    report = ec.check_step("mlp", device_cases.mean_step, world_size=2, device="cuda")
    outcome = report.outcomes[0]
    assert outcome.verdict is ec.Verdict.EQUIVALENT, report.describe()
    assert "gloo ranks on the CPU" in outcome.reason


@needs_cuda
def test_a_teams_step_on_one_gpu_rank_trains_over_nccl():
    report = ec.check_step("mlp", device_cases.mean_step, world_size=1, device="cuda")
    assert report.outcomes[0].verdict is ec.Verdict.EQUIVALENT and not report.outcomes[0].reason, report.describe()


@pytest.mark.parametrize(("found", "moved"), [(0, False), (1, True), (2, False)])
def test_a_row_whose_ranks_cannot_have_a_gpu_each_trains_on_the_cpu_with_its_reference(monkeypatch, found, moved):
    """Its reference too: a reference on the GPU draws dropout from another generator and rounds in other kernels,
    and would be a false alarm against ranks on the CPU (the tp_dropout_rank_seeded twin on an H200, before). Without
    any GPU the whole check is skipped instead."""
    from equivcheck.check import _trains_on_cpu_instead

    gpus(monkeypatch, found)
    assert _trains_on_cpu_instead(ec.parse_regime("ddp:world_size=2"), "cuda") is moved
    assert not _trains_on_cpu_instead(ec.parse_regime("accumulate:chunks=2"), "cuda")
    assert not _trains_on_cpu_instead(ec.parse_regime("ddp:world_size=2"), "cpu")


def test_where_this_process_may_not_fork_a_trainer_the_kernel_probe_runs_in_a_fresh_interpreter(monkeypatch):
    from equivcheck.process import kernels

    monkeypatch.setattr(kernels, "fork_is_safe", lambda: False)
    monkeypatch.setattr(kernels.os, "fork", lambda: pytest.fail("forked a process that may have trained"))
    assert kernels.probe(ec.resolve_precision("bf16-autocast"), kernels.DEFAULT) == "ran"
