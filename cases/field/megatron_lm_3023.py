"""NVIDIA/Megatron-LM#3023: Megatron-FSDP divided the accumulated gradient shard by DP after every micro-batch.

Megatron-FSDP reduce-scatters each micro-batch's gradient as a sum over the data-parallel ranks and then applies
the 1/DP averaging factor. When gradients are sharded, the buffer the factor was applied to was the gradient shard
accumulated so far, not the bucket just reduced, so after K micro-batches the shard held
``(((g1 / DP + g2) / DP + g3) ... ) / DP + gK``: earlier micro-batches shrank by a factor that compounds and the
last one was never averaged, where one process gets ``(g1 + ... + gK) / DP``-equivalent gradients (the mean over
ranks, summed over micro-batches). The fix applies the factor to the freshly reduced bucket before it is added.
This module re-creates Megatron-FSDP's arithmetic in torch-native code: FSDP2 reduce-scatters a sum
(``set_gradient_divide_factor(1.0)``) into ``.grad`` and the team's step moves it into its own accumulated
gradient shard, scaling one or the other by 1/DP as Megatron-FSDP did before and after the fix.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import mesh_where

BUG = Bug("NVIDIA/Megatron-LM", "pull", 3023, "fsdp",
          "1/DP applied to the accumulated grad shard, not the new reduced bucket: the factor compounds",
          fix_acts="gradient")

MICRO_BATCHES = 3  # each rank's 6 samples of block_stack's 12: micro-batches of 2


def shard_summing(model):
    """The team's wrap: FSDP2 on every block and the root, its reduce-scatter summing over ranks (the step averages)."""
    mesh = mesh_where(model)
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh).set_gradient_divide_factor(1.0)
    root = fully_shard(model, mesh=mesh)
    root.set_gradient_divide_factor(1.0)
    return root


def train_step(model, optimizer, batch, scale_accumulated=False):
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)  # each rank's sum over the global count, times DP: the 1/DP average makes the mean
    data_parallel = dist.get_world_size()
    parameters = [p for p in model.parameters()]
    main_grads = [None] * len(parameters)  # the accumulated gradient shards
    for x, y in zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)):
        (F.cross_entropy(model(x), y, reduction="sum") * data_parallel / samples).backward()
        for i, p in enumerate(parameters):
            bucket, p.grad = p.grad, None  # this micro-batch's reduce-scattered sum over the ranks
            if main_grads[i] is None:
                main_grads[i] = torch.zeros_like(bucket)
            target = main_grads[i] if scale_accumulated else bucket  # the scaling target: the one-word fix
            target.mul_(1 / data_parallel)
            main_grads[i].add_(bucket)
    for p, grad in zip(parameters, main_grads):
        p.grad = grad
    optimizer.step()
    optimizer.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, scale_accumulated=True)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, wrap=shard_summing,
                         syncs_per_step=MICRO_BATCHES)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, wrap=shard_summing,
                         syncs_per_step=MICRO_BATCHES)
