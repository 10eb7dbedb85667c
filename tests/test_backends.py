"""The same distributed checks on every process-group backend this machine has: gloo always, nccl where
CUDA is (one rank: a GPU each, and a machine with a GPU has at least one). Each faithful verdict stands
beside a pitfall the same backend catches."""

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.precision import Precision

BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="nccl needs a CUDA device per rank: none here (gloo runs the same checks)"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_accumulation_matches_and_syncing_every_micro_batch_is_caught(backend):
    faithful, every = (f"{name}:world_size=1,chunks=3,backend={backend}"
                       for name in ("ddp_no_sync", "ddp_sync_every_micro_batch"))
    report = ec.check("ddp_sync_every_micro_batch", [faithful, every])
    assert report.outcome("ddp_sync_every_micro_batch", faithful).verdict is Verdict.EQUIVALENT
    caught = report.outcome("ddp_sync_every_micro_batch", every)
    assert caught.verdict is Verdict.EXPECTED_MISMATCH and "3 all-reduces per step instead of 1" in caught.reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed000_under_ddp_matches_and_its_bypass_syncs_nothing(backend):
    faithful, bypass = (f"{name}:world_size=1,chunks=3,backend={backend}"
                        for name in ("ddp_detached_partial", "ddp_detached_partial_sync_every_chunk"))
    report = ec.check("seed000_ddp", [faithful, bypass])
    assert report.outcome("seed000_ddp", faithful).verdict is Verdict.EQUIVALENT
    assert report.outcome("seed000_ddp", bypass).verdict is Verdict.EXPECTED_MISMATCH


def test_fsdp2_with_one_rank_calls_no_collective_and_that_is_faithful():
    """FSDP2 skips its reduce-scatter with one rank: expecting one per block was a false alarm."""
    report = ec.check("block_stack", ["fsdp:world_size=1", "fsdp_no_sync:world_size=1,chunks=3"])
    for outcome in report.outcomes:
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
        assert outcome.result.syncs == (0, 0, 0) and outcome.result.sync_wrappers == 5
    # The twin: two ranks reduce-scatter once per block per step, and left on every micro-batch, three times.
    (every,) = ec.check("block_stack", ["fsdp_sync_every_micro_batch:world_size=2,chunks=3"]).outcomes
    assert every.verdict is Verdict.COMMUNICATION and every.result.syncs == (15, 15, 15)


def test_a_cuda_only_mode_on_ranks_without_a_gpu_each_is_skipped_with_its_reason(monkeypatch):
    """Two gloo ranks sharing one GPU under FSDP2 crashed (SIGSEGV) on a 1-GPU machine: ranks that cannot have a GPU
    each train over gloo on the CPU, where fp16-autocast is not defined: never dispatched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, as far as placement can tell
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ec.Unavailable, match="^precision 'fp16-autocast' trains on cuda only, and device='cuda': 2 "
                                             "ranks need a GPU each and 1 is here"):
        ec.run("block_stack", "fsdp:world_size=2", dtype="fp16-autocast")
