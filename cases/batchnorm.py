"""Negative control: BatchNorm normalises by the statistics of whatever batch it sees.

The same holds per rank under DDP.

Micro-batches see other statistics than the global batch, so accumulation and sample-by-sample
training must be reported as mismatches. Retained-graph and detached-partial accumulation run the
BatchNorm trunk once on the global batch, so they stay exact: the harness must say both.
"""

import dataclasses
from functools import partial

import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from .cnn import data


def model():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))


batchnorm_cnn = ec.register_case(ec.Case(
    name="batchnorm_cnn",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=2,
    split=lambda m: (m[:4], m[4]),
    expect_mismatch={
        "sample_by_sample": "BatchNorm normalises each sample by its own statistics",
        "accumulate": "BatchNorm normalises each micro-batch by its own statistics",
        "ddp": "BatchNorm normalises each rank's shard by its own statistics (no SyncBatchNorm)",
        "ddp_no_sync": "BatchNorm normalises each rank's micro-batches by their own statistics",
    },
    description="negative control: BatchNorm2d under accumulation",
))


def groupnorm_model():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))


groupnorm_cnn = ec.register_case(dataclasses.replace(
    batchnorm_cnn,
    name="groupnorm_cnn",
    model=groupnorm_model,
    expect_mismatch={},
    description="twin of batchnorm_cnn: GroupNorm normalises each sample by its own statistics",
))

# The catalogue's entries that use these cases.
add_entry(Entry("BatchNorm under accumulation", "batchnorm_cnn", "accumulate:chunks=5", "accumulate:chunks=5",
                twin_case="groupnorm_cnn"))
add_entry(Entry("BatchNorm under DDP", "batchnorm_cnn", "ddp:world_size=2", "ddp:world_size=2", twin_case="groupnorm_cnn"))

batchnorm_cnn_synced = ec.register_case(dataclasses.replace(
    batchnorm_cnn,
    name="batchnorm_cnn_synced",
    regimes=("full_batch", "ddp:world_size=2", "sync_batchnorm:world_size=2"),
    expect_mismatch={"ddp": "BatchNorm normalises each rank's shard by its own statistics (no SyncBatchNorm)"},
    description="twin of BatchNorm under DDP: SyncBatchNorm normalises by the global batch (GPUs only)",
))
