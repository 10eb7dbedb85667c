"""deepspeedai/DeepSpeed#1800: ZeRO with bf16 accumulated the micro-batches' gradients in bf16, not fp32.

A bf16 model under ZeRO keeps each parameter in bfloat16 and its fp32 master copy in the optimizer; with gradient
accumulation the micro-batches' gradients were summed in the bf16 parameters' ``.grad`` (fp16 ones in fp16), so the
running sum was rounded to bfloat16 after every micro-batch, and only the sum reached the fp32 partition. The issue
(open; stas00) expects little effect without accumulation and a significant accumulated error with many micro-batches,
as many-stage pipelines run, and asks for fp32 accumulation by default: ``BF16_Optimizer`` already had it (each
backward's bf16 gradient added into an fp32 buffer, ``update_hp_grads``), ZeRO-1 with bf16 was later routed to it, and
``data_types.grad_accum_dtype`` chooses the buffer (with a bf16 buffer the fp32 partitions were handed no gradient at
``step()`` until pull #6485 cast it there). Here the mlp case trains under the ``bf16-master`` policy (fp32 master
weights, each module computing on a bfloat16 copy) against one process under the same policy, the team's step
accumulating 4 micro-batches: as reported, each parameter's gradient is held on bfloat16's grid after every micro-batch,
as a bf16 ``.grad`` accumulates; as fixed, the micro-batches' bf16 gradients add up in the fp32 master gradient. The
rounding added is real but under bf16's tolerance (``known_miss``).
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

MICRO_BATCHES = 4

BUG = Bug("deepspeedai/DeepSpeed", "issue", 1800, "precision",
          "ZeRO bf16 summed micro-batch gradients in the bf16 params' .grad: rounded to bf16 per micro-batch",
          fixed_by="open; BF16_Optimizer's fp32 accumulation (update_hp_grads), grad_accum_dtype fp32",
          fix_acts="gradient",
          known_miss="rounding the running gradient sum to bfloat16 after each of 4 micro-batches moves the run by "
                     "0.085 of bf16-master's tolerance (rtol 1.6e-2, atol 2^-8; measured against the same step "
                     "accumulating in fp32, itself 0.36 from one process by the micro-batches' own bf16 rounding): "
                     "the tolerance allows bf16's rounding of every gradient, and a few roundings more are under it "
                     "(at float32's tolerance the two steps differ by margin 64)")


def train_step(model, optimizer, batch, accumulate_in_bf16=False):
    """The team's step: 4 micro-batches, each its loss sum over the batch's samples, backward; as reported the
    gradient sum kept in bfloat16 after each backward (the bf16 parameter's own ``.grad``); one step."""
    inputs, targets = batch
    total = 0.0
    for micro_inputs, micro_targets in zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)):
        loss = F.cross_entropy(model(micro_inputs), micro_targets, reduction="sum") / len(targets)
        loss.backward()
        total += loss.detach()
        if accumulate_in_bf16:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.grad.copy_(parameter.grad.to(torch.bfloat16))
    optimizer.step()
    optimizer.zero_grad()
    return total


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, accumulate_in_bf16=True)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, dtype="bf16-master")


def fixed():
    return ec.check_step("mlp", train_step, dtype="bf16-master")
