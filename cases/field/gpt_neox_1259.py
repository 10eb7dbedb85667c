"""EleutherAI/gpt-neox#1259: the sequence-parallel LayerNorm gradient hook averaged over TP instead of summing.

gpt-neox's Megatron-style sequence parallelism (pull #1257) runs the norms on each TP rank's chunk of the sequence,
so a norm's gradient on one rank holds only that chunk's sum. It registers, on every parameter of a module whose
class name contains "norm", a gradient hook (``reduce_weight_grads_from_model_parallel_region``) that all-reduces the
gradient over the model-parallel group. As first written the hook averaged, dividing the all-reduced sum by the TP
size: the ranks agreed, but every norm parameter stepped with 1/TP of the gradient one process computes over the
whole sequence (its hooks were also registered before ``deepspeed.initialize``, where they never fired; that half is
the class of NVIDIA/Megatron-LM#1446, and this row checks the hook once it fires). The fix (pull #1259, into #1257)
registers the hooks after ``deepspeed.initialize`` and sums. Here the team's model (``_tensor.TinyGPT``, SP on 2
ranks) registers the hooks when it is parallelised; its sharded weights are DTensors, its norms plain tensors.
"""

import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import megatron_parallelize, token_step

BUG = Bug("EleutherAI/gpt-neox", "pull", 1259, "tensor",
          "SP LayerNorm grad hook averaged over the TP group instead of summing: norms stepped 1/TP too little",
          fix_acts="communication")


_MODEL_PARALLEL_GROUP = None  # mpu's model-parallel (TP) group, set when the model is parallelised


def reduce_weight_grads_from_model_parallel_region(input_, average=False):
    """The hook: all-reduce a norm parameter's gradient over the model-parallel (TP) group."""
    group = _MODEL_PARALLEL_GROUP
    if dist.get_world_size(group) == 1:
        return input_
    dist.all_reduce(input_, group=group)
    if average:
        input_ = input_ / dist.get_world_size(group)
    return input_


def reduce_as_reported(input_):
    return reduce_weight_grads_from_model_parallel_region(input_, average=True)


def mark_norms_for_sequence_parallel_grad_sync(model, hook):
    for module in model.modules():
        if "norm" in type(module).__name__.lower():
            for parameter in module.parameters():
                if parameter.requires_grad:
                    parameter.register_hook(hook)


def sequence_parallel(model, mesh, hook=reduce_weight_grads_from_model_parallel_region):
    """The team's setup: Megatron-style TP + SP over mesh['tp'], then the norms' hooks."""
    global _MODEL_PARALLEL_GROUP
    model = megatron_parallelize(model, mesh, sequence_parallel=True)
    _MODEL_PARALLEL_GROUP = model.tp_group
    mark_norms_for_sequence_parallel_grad_sync(model, hook)
    return model


def sequence_parallel_as_reported(model, mesh):
    return sequence_parallel(model, mesh, hook=reduce_as_reported)


def train_step(model, optimizer, batch):
    return token_step(model, optimizer, batch)  # the hooks sum the norms' chunks as each gradient arrives


def buggy():
    return ec.check_step("field_tiny_gpt", train_step, mesh={"tp": 2}, parallelize=sequence_parallel_as_reported)


def fixed():
    return ec.check_step("field_tiny_gpt", train_step, mesh={"tp": 2}, parallelize=sequence_parallel)
