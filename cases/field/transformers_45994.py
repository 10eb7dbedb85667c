"""huggingface/transformers#45994: under DP x TP the Trainer multiplied the loss by every process, TP ranks included.

With ``average_tokens_across_devices`` the Trainer gathers each rank's count of loss items, sums it over all
processes and, since TP ranks hold copies of the same batch, divides by the non-data-parallel size: the global count
``num_items_in_batch``. The model returns its rank's loss sum over that global count, and ``compute_loss`` multiplies
it by ``accelerator.num_processes`` so that the data-parallel average (FSDP's reduce-scatter divides by the DP size)
gives back the global mean. With TP on (or EP borrowed as TP), the processes are DP x TP, so the loss and every
gradient came out ``tp_size`` times too large (the pull measured a loss of 47.88 for 11.97 with FSDP2 on DP 2 x EP 4,
whose EP ranks hold copies of one batch as TP ranks do), where one process trains on the global batch's mean. The
fix (pull #45994) multiplies by the number of data-parallel replicas only. Here the built-in
``tp_mlp`` runs on a 2 x 2 mesh: the team's plan shards its MLP colwise then rowwise over ``tp`` with
``parallelize_module`` and FSDP2 shards it over ``dp``; each TP group gets its DP shard of the global batch.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "pull", 45994, "tensor",
          "DP x TP: loss scaled by num_processes (DP x TP) instead of the DP size: grads tp_size x too large",
          fix_acts="loss")

MESH = {"dp": 2, "tp": 2}


def fsdp_and_tensor_parallel(model, mesh):
    """The team's plan: the MLP colwise then rowwise over tp, FSDP2 over dp."""
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=mesh["dp"])


def training_step(model, optimizer, batch, scale=lambda: dist.get_world_size() // MESH["tp"]):
    inputs, targets = batch
    # Trainer._get_num_items_in_batch: gathered over all processes, divided by the non-data-parallel size
    num_items_in_batch = torch.tensor(float(targets.numel()), dtype=torch.float64)
    dist.all_reduce(num_items_in_batch)
    num_items_in_batch = num_items_in_batch // MESH["tp"]
    # the model's loss given num_items_in_batch, then compute_loss's average_tokens_across_devices scaling
    loss = F.cross_entropy(model(inputs), targets, reduction="sum") / num_items_in_batch
    (loss * scale()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach() * num_items_in_batch / targets.numel()  # this DP shard's mean


def training_step_as_reported(model, optimizer, batch):
    return training_step(model, optimizer, batch, scale=dist.get_world_size)  # accelerator.num_processes


def buggy():
    return ec.check_step("tp_mlp", training_step_as_reported, mesh=MESH, parallelize=fsdp_and_tensor_parallel)


def fixed():
    return ec.check_step("tp_mlp", training_step, mesh=MESH, parallelize=fsdp_and_tensor_parallel)
