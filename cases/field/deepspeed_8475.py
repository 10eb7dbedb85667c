"""deepspeedai/DeepSpeed#8475: the fp32 clip averaged per-rank norms, though ranks held different experts.

DeepSpeed's ``clip_grad_norm_`` (``deepspeed/runtime/utils.py``, the path ``clip_fp32_gradients`` takes with
``mpu=None``) computes the norm of the gradients a rank holds, then divides it by the data-parallel world size and
all-reduces it: the mean of the ranks' norms. That is the global norm only while every rank holds the same
parameters. Under expert parallelism each rank holds its own experts, so rank r's norm is sqrt(D + E_r) (D the
replicated layers' squares, E_r its experts') and the mean of those is below sqrt(D + E_0 + E_1): the report saw
the clip coefficient shift by 0.2 with where the experts live, and pull #8478's two ranks give (sqrt(20) +
sqrt(100)) / 2 = 7.236 for sqrt(120) = 10.954, 34% low. Pull #8478 (open) keeps the experts out of the replicated
norm and folds them in as ``get_norm_with_moe_layers`` does: their squares summed over the expert-parallel group,
added to the replicated layers' squares counted once, then the root. Here the 4 experts of ``field_moe_vectors`` live
two to a rank on 2 gloo ranks, tokens exchanged by ``all_to_all``, and ``max_norm`` is below the gradient norm at
both steps.
"""

import functools

import torch
import torch.distributed as dist

from equivcheck.suites.field import Bug
from equivcheck_cases.field._clipping import (MAX_NORM, ep_group, expert_parallel, expert_parallel_check,
                                              expert_parallel_step, scale_)
from equivcheck_cases.field._references import clipped_once

BUG = Bug("deepspeedai/DeepSpeed", "issue", 8475, "clipping",
          "fp32 clip averaged per-rank norms over DP, though each rank held other experts: norm too small",
          fixed_by="pull #8478 (open)", fix_acts="gradient")


def parallelize(model, mesh):
    """The experts over the EP group, marked as DeepSpeed's MoE layer marks them: ``allreduce = False``."""
    return expert_parallel(model, mesh, allreduce=False, group_name="ep_size_2")


def is_moe_param(parameter):
    return hasattr(parameter, "allreduce") and not parameter.allreduce


def clip_grad_norm_(parameters, max_norm, experts_once=True):
    """DeepSpeed's fp32 clip with ``mpu=None``. As reported: this rank's norm over every gradient it holds, divided by
    the data-parallel world size and all-reduced. ``experts_once`` (pull #8478): the replicated gradients' squares
    counted here once, the experts' squares summed over the expert-parallel group, both before the root."""
    parameters = [p for p in parameters if p.grad is not None]
    if experts_once:
        dense = sum((p.grad.detach().norm(2) ** 2 for p in parameters if not is_moe_param(p)), torch.zeros(()))
        experts = sum((p.grad.detach().norm(2) ** 2 for p in parameters if is_moe_param(p)), torch.zeros(()))
        dist.all_reduce(experts, group=ep_group())
        total_norm = (dense + experts).sqrt()
    else:
        total_norm = torch.stack([p.grad.detach().norm(2) for p in parameters]).square().sum().pow(0.5)
        scaled_norm = total_norm * 1.0 / float(dist.get_world_size())  # groups._get_data_parallel_group(): all ranks
        dist.all_reduce(scaled_norm)
        total_norm = scaled_norm
    return scale_([p.grad for p in parameters], max_norm, total_norm)


def clip_fp32_gradients(model, experts_once=True):
    return clip_grad_norm_(model.parameters(), MAX_NORM, experts_once)


def train_step(model, optimizer, batch):
    return expert_parallel_step(model, optimizer, batch, clip_fp32_gradients)


def train_step_as_reported(model, optimizer, batch):
    return expert_parallel_step(model, optimizer, batch, functools.partial(clip_fp32_gradients, experts_once=False))

clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return expert_parallel_check(train_step_as_reported, clip_once_with_the_global_norm, parallelize)


def fixed():
    return expert_parallel_check(train_step, clip_once_with_the_global_norm, parallelize)
