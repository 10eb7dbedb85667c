"""SyncBatchNorm under DDP: the twin of BatchNorm under DDP; skipped with torch's reason where there are no GPUs."""

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS >= 2, reason="checks the skip on a machine without 2 CUDA devices")
def test_sync_batchnorm_is_skipped_with_torchs_reason_on_the_cpu():
    (outcome,) = ec.check("batchnorm_cnn_synced", ["sync_batchnorm:world_size=2"]).outcomes
    assert outcome.verdict is Verdict.SKIPPED
    assert "SyncBatchNorm layers only work with GPU modules" in outcome.reason


@pytest.mark.skipif(GPUS < 2, reason="SyncBatchNorm needs nccl with a CUDA device per rank: 2 asked")
def test_sync_batchnorm_matches_full_batch_where_plain_ddp_does_not():
    report = ec.check("batchnorm_cnn_synced")
    assert report.outcome("batchnorm_cnn_synced", "sync_batchnorm:world_size=2").verdict is Verdict.EQUIVALENT
    assert report.outcome("batchnorm_cnn_synced", "ddp:world_size=2").verdict is Verdict.EXPECTED_MISMATCH
