"""Lightning-AI/pytorch-lightning#21859: ``sync_dist`` averaged an integer batch-size count, which floors.

For ``self.log(..., on_epoch=True, sync_dist=True)`` Lightning keeps, per rank, the sum of each logged value times
its batch size and, in an integer tensor, the sum of the batch sizes; at the epoch's end it mean-reduces both over
the ranks and divides. That ratio would be the sample-weighted mean one process computes, but the mean of the
integer count is truncated (gloo: summed, divided, copied back into the integer tensor), so when the ranks' samples
do not divide by the world size the denominator is too small and the epoch metric too large (1.375 times at 44
samples on 16 ranks). The fix syncs the count in the value's floating dtype.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("Lightning-AI/pytorch-lightning", "issue", 21859, "evaluation",
          "sync_dist epoch mean: the integer batch-size total mean-synced, floored", fixed_by="pull #21839",
          fix_acts="metric")

# 11 validation samples over 2 ranks: shards of 6 and 5, whose mean count 5.5 floors to 5.
SAMPLES = ec.register_case(ec.Case(
    name="field_val_samples", model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
    data=lambda: (torch.randn(11, 4), torch.randn(11, 1)), loss=lambda out, y: F.mse_loss(out, y, reduction="none").mean(1),
    batch_size=11, description="11 validation samples; a rank's shard holds every other one, unpadded"))


def sync_ddp_mean(result):
    """Lightning's ``_sync_ddp`` with reduce_op="mean" on gloo: summed in place, then divided by the world size."""
    dist.all_reduce(result, op=dist.ReduceOp.SUM)
    if not torch.is_floating_point(result):
        return result.copy_(result / dist.get_world_size())
    return result.div_(dist.get_world_size())


class ResultMetric:
    """What ``self.log(name, value, on_epoch=True, sync_dist=True, batch_size=n)`` keeps for a mean."""

    def __init__(self, sync_in_value_dtype=True):
        self.value = torch.tensor(0.0, dtype=torch.float64)
        self.cumulated_batch_size = torch.tensor(0)
        self.sync_in_value_dtype = sync_in_value_dtype

    def update(self, value, batch_size):
        self.value += value.mean() * batch_size
        self.cumulated_batch_size += batch_size

    def compute(self):
        if not dist.is_initialized():
            return self.value / self.cumulated_batch_size
        value = sync_ddp_mean(self.value)
        count = self.cumulated_batch_size.to(value.dtype) if self.sync_in_value_dtype else self.cumulated_batch_size
        return value / sync_ddp_mean(count)


def my_shard(dataset):
    """This rank's samples, every W-th from its rank (the team's own split: no padding)."""
    if not dist.is_initialized():
        return dataset
    return Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))


def validation_epoch(model, dataset, sync_in_value_dtype=True):
    val_loss = ResultMetric(sync_in_value_dtype)
    for x, y in DataLoader(my_shard(dataset), batch_size=4):  # validation_step, then self.log(...)
        val_loss.update(F.mse_loss(model(x), y), batch_size=len(y))
    return {"val_loss": val_loss.compute()}


def validation_epoch_as_reported(model, dataset):
    return validation_epoch(model, dataset, sync_in_value_dtype=False)


def buggy():
    return ec.check_eval(SAMPLES, validation_epoch_as_reported)


def fixed():
    return ec.check_eval(SAMPLES, validation_epoch)
