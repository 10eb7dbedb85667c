"""mosaicml/composer#2218: the evaluator counted the samples DistributedSampler repeats to pad the last shards.

Composer evaluates on every rank through a ``DistributedSampler``, which pads the index list to a multiple of the
world size by repeating its first indices, and each rank updated its metric state (correct and total counts, loss
sum and count) with every sample of every batch it got; the states were then summed over the ranks. With a dataset
that does not divide over the ranks, the repeated samples counted twice, so the accuracy and loss were over N plus
the padding, where one process evaluates each of the N samples once. The fix ("exact eval") works out, on the last
batch, whether this rank's final sample is padding (ranks ``>= world_size - padding`` hold one) and slices it off
before the metrics are updated.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("mosaicml/composer", "pull", 2218, "evaluation",
          "eval metrics updated with DistributedSampler's padded duplicates: N + padding samples counted",
          fix_acts="metric")

# mlp's model on 9 samples: over 2 ranks DistributedSampler pads to 10, repeating sample 0 on rank 1.
ODD_EVAL = ec.register_case(ec.Case(
    name="field_composer_odd_eval", model=ec.get_case("mlp").model,
    data=lambda: (torch.randn(9, 6), torch.randint(0, 3, (9,))),
    loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    batch_size=9, description="mlp's classifier on 9 eval samples: 2 ranks get 5 each, one of them a repeat"))

BATCH_SIZE = 2


def eval_loop(model, dataset, exact=True):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    dataloader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    state = torch.zeros(4, dtype=torch.float64)  # correct, total, loss sum, loss count: the metrics' states
    for batch_idx, (x, y) in enumerate(dataloader):
        if exact and batch_idx + 1 == len(dataloader):  # the last batch: drop this rank's padded sample, if any
            padding = sampler.total_size - len(dataset)
            if rank >= world - padding:
                x, y = x[:-1], y[:-1]
        outputs = model(x)
        state += torch.stack([(outputs.argmax(-1) == y).sum().double(), torch.tensor(float(len(y))),
                              F.cross_entropy(outputs, y, reduction="sum"), torch.tensor(float(len(y)))])
    if dist.is_initialized():
        dist.all_reduce(state)  # torchmetrics' sync: the ranks' states summed
    return {"accuracy": state[0] / state[1], "cross_entropy": state[2] / state[3]}


def eval_loop_as_reported(model, dataset):
    return eval_loop(model, dataset, exact=False)


def buggy():
    return ec.check_eval(ODD_EVAL, eval_loop_as_reported)


def fixed():
    return ec.check_eval(ODD_EVAL, eval_loop)
