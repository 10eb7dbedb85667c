"""deepspeedai/DeepSpeed#7967: ZeRO-1/2 with CPU offload kept only the first micro-step's gradient.

With ``offload_optimizer`` and ``gradient_accumulation_steps = K``, ZeRO-1/2 moves each micro-step's reduced
gradient partition into an fp32 buffer on the CPU, where the optimizer steps. After pull #6550 the partition was
copied into that buffer only when ``micro_step_id == 0`` and dropped on micro-steps 1 to K-1, so the update (and
the reported gradient norm) used the first micro-batch's gradient, where one process uses the gradient of all K.
The fix copies on the first micro-step and adds on every later one. This module re-creates DeepSpeed's arithmetic
in torch-native code around ``ZeroRedundancyOptimizer`` (ZeRO-1 over DDP): every micro-step's backward all-reduces,
as ZeRO-2 reduces every micro-step, the team's step moves the gradient into its CPU buffer with DeepSpeed's
copy-or-add rule, and the optimizer steps on the buffer.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("deepspeedai/DeepSpeed", "pull", 7967, "zero",
          "ZeRO-1/2 CPU offload: micro-steps after the first dropped, not added to the fp32 buffer",
          fix_acts="gradient")

GRADIENT_ACCUMULATION_STEPS = 3  # each rank's 6 samples of block_stack's 12: micro-batches of 2


def zero(optimizer):
    """The team's ZeRO: the optimizer they were given, its state sharded over the ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # scripts optimizers with torch.jit on import

    return ZeroRedundancyOptimizer(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer),
                                   **optimizer.defaults)


def offload(buffers, parameters, micro_step_id, adds_later_steps=True):
    """Move each reduced gradient into its CPU fp32 buffer: copy on micro-step 0, add on later ones (as fixed)."""
    for buffer, p in zip(buffers, parameters):
        if micro_step_id == 0:
            buffer.copy_(p.grad.to("cpu", torch.float64))
        elif adds_later_steps:
            buffer.add_(p.grad.to("cpu", torch.float64))
        p.grad = None  # the device copy is freed


def train_step(model, optimizer, batch, adds_later_steps=True):
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)  # each rank's sum over the global count, times W: DDP's average is the global mean
    parameters = list(model.parameters())
    buffers = [torch.zeros_like(p, device="cpu", dtype=torch.float64) for p in parameters]
    chunks = zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), targets.chunk(GRADIENT_ACCUMULATION_STEPS))
    for micro_step_id, (x, y) in enumerate(chunks):
        (F.cross_entropy(model(x), y, reduction="sum") * dist.get_world_size() / samples).backward()
        offload(buffers, parameters, micro_step_id, adds_later_steps)
    for p, buffer in zip(parameters, buffers):
        p.grad = buffer.to(p.device, p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, adds_later_steps=False)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, world_size=2, optimizer_wrap=zero,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)


def fixed():
    return ec.check_step("block_stack", train_step, world_size=2, optimizer_wrap=zero,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)
