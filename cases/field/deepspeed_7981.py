"""deepspeedai/DeepSpeed#7981: ZeRO-1/2 CPU offload with several backward calls per step kept only the last one.

A caller that accumulates by itself tells DeepSpeed ``gradient_accumulation_steps = 1`` and calls ``backward()``
several times before ``step()``, marking only the last call as the accumulation boundary. With ``offload_optimizer``,
ZeRO-1/2 summed a backward's reduced gradient partition into its CPU accumulator only when the configured
accumulation steps exceeded one, and at the boundary copied the partition over the fp32 buffer the optimizer steps
on: every backward but the last was dropped, and the update used the last micro-batch's gradient where one process
uses the sum over all of them. The fix accumulates whenever more than one backward feeds the step
(``micro_step_id > 0`` or not at the boundary). This module re-creates that arithmetic in torch-native code around
``ZeroRedundancyOptimizer`` (ZeRO-1 over DDP), every backward all-reducing as ZeRO-2 reduces each one. Its
mechanism differs from #7967 (the first micro-step kept, the later ones dropped under ``gradient_accumulation_steps >
1``): here the accumulator is skipped altogether and the boundary's copy keeps the last backward only.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("deepspeedai/DeepSpeed", "pull", 7981, "zero",
          "ZeRO-1/2 CPU offload, GA=1 with several backward() per step: only the last backward kept",
          fix_acts="gradient")

GRADIENT_ACCUMULATION_STEPS = 1  # DeepSpeed's config: the caller accumulates by itself
BACKWARDS_PER_STEP = 3  # each rank's 6 samples of block_stack's 12: micro-batches of 2


def sharded_optimizer(optimizer):
    """ZeRO-1: the case's optimizer, its state sharded over the ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # scripts optimizers with torch.jit on import

    return ZeroRedundancyOptimizer(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer),
                                   **optimizer.defaults)


class CpuOffload:
    """ZeRO-1/2's offloaded gradients: a CPU accumulator across backward calls and the fp32 buffer the step uses."""

    def __init__(self, parameters, gates_on_micro_steps=True):
        self.parameters = parameters
        self.accumulated = [torch.zeros_like(p, device="cpu") for p in parameters]
        self.fp32_buffer = [torch.zeros_like(p, device="cpu") for p in parameters]
        self.gates_on_micro_steps = gates_on_micro_steps

    def copy_grads_in_partition(self, micro_step_id, is_gradient_accumulation_boundary):
        accumulates = (micro_step_id > 0 or not is_gradient_accumulation_boundary if self.gates_on_micro_steps
                       else GRADIENT_ACCUMULATION_STEPS > 1)
        for p, accumulated, fp32 in zip(self.parameters, self.accumulated, self.fp32_buffer):
            grad = p.grad  # this backward's reduced partition
            if accumulates:  # async_accumulate_grad_in_cpu_via_gpu
                if micro_step_id > 0:
                    grad.add_(accumulated.to(grad.device))
                accumulated.copy_(grad.to("cpu"))
            if is_gradient_accumulation_boundary:  # async_inplace_copy_grad_to_fp32_buffer_from_gpu
                fp32.copy_(grad.to("cpu"))
            p.grad = None  # the device partition is freed for the next backward


def train_step(model, optimizer, batch, gates_on_micro_steps=True):
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)  # each rank's sum over the global count, times W: DDP's average is the global mean
    parameters = list(model.parameters())
    offload = CpuOffload(parameters, gates_on_micro_steps)
    chunks = list(zip(inputs.chunk(BACKWARDS_PER_STEP), targets.chunk(BACKWARDS_PER_STEP)))
    for micro_step_id, (x, y) in enumerate(chunks):
        boundary = micro_step_id == len(chunks) - 1  # set_gradient_accumulation_boundary: the last backward only
        (F.cross_entropy(model(x), y, reduction="sum") * dist.get_world_size() / samples).backward()
        offload.copy_grads_in_partition(micro_step_id, boundary)
    for p, fp32 in zip(parameters, offload.fp32_buffer):
        p.grad = fp32.to(p.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, gates_on_micro_steps=False)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, optimizer_wrap=sharded_optimizer,
                         syncs_per_step=BACKWARDS_PER_STEP)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, optimizer_wrap=sharded_optimizer,
                         syncs_per_step=BACKWARDS_PER_STEP)
