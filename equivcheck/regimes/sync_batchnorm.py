"""BatchNorm converted to SyncBatchNorm under DDP: every rank normalises by the statistics of the whole
global batch, the twin of "BatchNorm under DDP". PyTorch runs SyncBatchNorm on GPUs only, so on the CPU
the regime is skipped with torch's own reason, never emulated.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..case import Objective
from ..device import DEFAULT_DEVICE
from .ddp import Ddp

# What DistributedDataParallel raises for a SyncBatchNorm module on the CPU (torch 2.13).
TORCH_REFUSAL = "SyncBatchNorm layers only work with GPU modules"


@dataclasses.dataclass(frozen=True)
class SyncBatchNorm(Ddp):
    name = "sync_batchnorm"
    summary = "ddp with every BatchNorm converted to SyncBatchNorm: global-batch statistics on every rank (GPUs only)"

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        if not self.placement(device).on_gpus:
            return (f"torch: {TORCH_REFUSAL!r}; it needs nccl with a CUDA device per rank "
                    f"({self.world_size} asked, device={device!r})")
        return super().unavailable(device)

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        return self.ddp(nn.SyncBatchNorm.convert_sync_batchnorm(model))
