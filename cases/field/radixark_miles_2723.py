"""radixark/miles#2723: with fused weight-gradient accumulation the replicated LoRA factor's sync hook reduced a dummy.

Megatron-Bridge keeps the replicated outer factor of its shared-outer expert adapters in sync across ranks with a
Parameter hook: autograd hands the hook the factor's gradient and the hook SUM-all-reduces it. With fused
weight-gradient accumulation (``gradient_accumulation_fusion``, the default of most PEFT recipes) the weight-gradient
kernel writes the real gradient straight into ``param.main_grad`` and hands autograd a dummy tensor: the hook reduced
the dummy, and the optimizer consumed each rank's local ``main_grad``. The pull found every replicated expert-fc1
``lora_A`` split into eight TP hashes after the second update of a GLM-5.2 run. It SUM-all-reduces the replicated
factor's ``main_grad`` itself when fusion is on (and keeps the hook path when it is off, so nothing is reduced twice).
Scaled down: the tiny GPT frozen with rank-2 adapters (``_lora_tp.py``), TP = 2 with SP, where ``up``'s replicated
``lora_a`` sees this rank's sequence chunk, its weight gradient accumulated into ``main_grad`` by a fused kernel and
both replicated factors carrying the Bridge hook; as reported nothing else reduces ``main_grad``, as fixed the step
all-reduces it over the TP group before the optimizer reads it.
"""

import torch
import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._lora_tp import lora_parallelize

BUG = Bug("radixark/miles", "pull", 2723, "adapters",
          "fused weight-gradient accumulation: the replicated LoRA factor's sync hook reduced a dummy grad",
          fix_acts="communication up_adapter")


class LinearWithGradAccumulationFusion(torch.autograd.Function):
    """``inputs @ weight^T``, the weight's gradient added into ``weight.main_grad`` by the kernel, and a dummy of
    zeros handed to autograd in its place, as Megatron's fused weight-gradient path does."""

    @staticmethod
    def forward(ctx, inputs, weight):
        ctx.save_for_backward(inputs)
        ctx.weight = weight  # the parameter itself, which carries main_grad
        return inputs @ weight.T

    @staticmethod
    def backward(ctx, grad_output):
        (inputs,), weight = ctx.saved_tensors, ctx.weight
        weight.main_grad.add_(grad_output.flatten(0, -2).T @ inputs.flatten(0, -2))
        return grad_output @ weight, torch.zeros_like(weight)


def fused_linear(inputs, weight):
    return LinearWithGradAccumulationFusion.apply(inputs, weight)


def sum_over_tp(grad):
    """Bridge's Parameter hook on a replicated factor: its gradient SUM-all-reduced over the TP group."""
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def with_fusion(model, mesh):
    """Megatron form with the replicated factors synced by Bridge's hook, ``up``'s applied by the fused kernel."""
    model = lora_parallelize(model, mesh, flag_replicated=False)
    for factor in (model.up_adapter.lora_a, model.down_adapter.lora_b):
        factor.register_hook(sum_over_tp)
    model.up_adapter.lora_a.main_grad = torch.zeros_like(model.up_adapter.lora_a)
    model.replicated_linear = fused_linear
    return model


def train_step(model, optimizer, batch, reduce_main_grad=True):
    inputs, targets = batch
    factor = model.up_adapter.lora_a
    factor.main_grad.zero_()
    loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, 4), targets.reshape(-1))
    loss.backward()
    if reduce_main_grad:  # the pull: the optimizer-facing main_grad SUM-all-reduced over the TP group
        dist.all_reduce(factor.main_grad)
    factor.grad = factor.main_grad.clone()  # what the optimizer reads: the fused buffer, not autograd's dummy
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, reduce_main_grad=False)


def buggy():
    return ec.check_step("field_lora_gpt", train_step_as_reported, mesh={"tp": 2}, parallelize=with_fusion)


def fixed():
    return ec.check_step("field_lora_gpt", train_step, mesh={"tp": 2}, parallelize=with_fusion)
