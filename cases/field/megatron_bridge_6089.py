"""NVIDIA-NeMo/Megatron-Bridge#6089: with shared-expert overlap, the deferred TP reduction summed LoRA's delta TP times.

Under ``moe_shared_expert_overlap`` the shared expert's linears run with explicit TP communication: FC2's
tensor-parallel reduction is deferred, so the base's output leaves the layer as a partial sum that a later
all-reduce completes. LoRA's adapter on FC2 (``ParallelLinearAdapter``) already returns a replicated, whole
contribution, which joined the partial output and was then reduced with it: the delta counted once per TP rank (the
pull's two-rank regression: the output doubles). The pull scales that forward contribution by ``1 / TP`` while keeping
the gradient of the equivalent adapter without overlap. Scaled down: the tiny GPT frozen with rank-2 adapters
(``_lora_tp.py``), TP = 2 without SP, ``down`` standing for FC2 with its reduction deferred past the adapter's join;
as reported the delta joins unscaled, as fixed scaled by ``1 / TP`` in the forward, its gradient passed through whole.
"""

import torch
import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._lora_tp import lora_parallelize
from equivcheck_cases.field.mcore_bridge_173 import train_step

BUG = Bug("NVIDIA-NeMo/Megatron-Bridge", "pull", 6089, "adapters",
          "shared-expert overlap: FC2's deferred TP reduction summed the replicated LoRA delta once per rank",
          fix_acts="forward")


class ScaleForward(torch.autograd.Function):
    """The delta times ``scale`` in the forward; its gradient passed through as the adapter without overlap gets it."""

    @staticmethod
    def forward(ctx, delta, scale):
        return delta * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def joined_as_reported(delta):
    return delta


def joined_as_fixed(delta):
    return ScaleForward.apply(delta, 1 / dist.get_world_size())


def overlapped_as_reported(model, mesh):
    model = lora_parallelize(model, mesh, sequence_parallel=False)
    model.join_partial = joined_as_reported
    return model


def overlapped(model, mesh):
    model = lora_parallelize(model, mesh, sequence_parallel=False)
    model.join_partial = joined_as_fixed
    return model


def buggy():
    return ec.check_step("field_lora_gpt", train_step, mesh={"tp": 2}, parallelize=overlapped_as_reported)


def fixed():
    return ec.check_step("field_lora_gpt", train_step, mesh={"tp": 2}, parallelize=overlapped)
