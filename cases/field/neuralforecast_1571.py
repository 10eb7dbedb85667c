"""Nixtla/neuralforecast#1571: the validation loss on several devices was the mean of each device's mean.

Each rank averaged the loss over its own validation windows and the logger's ``sync_dist=True`` averaged those
per-rank values with equal weights. Where ranks hold different numbers of windows, a window on the smaller rank
weighs more than one on the larger: the logged loss differed from the loss one process computes over the same
windows. The fix keeps each rank's loss sum and window count, gathers both and divides the totals.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("Nixtla/neuralforecast", "pull", 1571, "evaluation",
          "validation loss: per-rank means averaged with equal weights over uneven shards", fix_acts="metric")

# 11 windows of 4 lags over 2 ranks: the shards hold 6 and 5.
WINDOWS = ec.register_case(ec.Case(
    name="field_forecast_windows", model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
    data=lambda: (torch.randn(11, 4), torch.randn(11, 1)), loss=lambda out, y: F.mse_loss(out, y, reduction="none").mean(1),
    batch_size=11, description="11 forecast windows of 4 lags; a rank's shard holds every other one"))


def my_windows(dataset):
    """This rank's windows, every W-th from its rank, as the team's data module splits them (no padding)."""
    if not dist.is_initialized():
        return dataset
    return Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))


def loss_sum_and_count(model, dataset):
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in DataLoader(my_windows(dataset), batch_size=4):
        total += torch.stack([F.mse_loss(model(x), y, reduction="sum"), torch.tensor(float(len(y)))])
    return total


def validation_loss(model, dataset):
    total = loss_sum_and_count(model, dataset)
    if dist.is_initialized():
        dist.all_reduce(total)
    return {"valid_loss": total[0] / total[1]}


def validation_loss_as_reported(model, dataset):
    loss, count = loss_sum_and_count(model, dataset)
    mean = loss / count
    if dist.is_initialized():  # sync_dist=True: the ranks' values averaged
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return {"valid_loss": mean}


def buggy():
    return ec.check_eval(WINDOWS, validation_loss_as_reported)


def fixed():
    return ec.check_eval(WINDOWS, validation_loss)
