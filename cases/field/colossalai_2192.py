"""hpcaitech/ColossalAI#2192: with MoE expert parallelism the clip never summed the experts' norms across EP ranks.

ColossalAI's ``clip_grad_norm_fp32`` (``colossalai/utils/common.py``) splits the gradients into tensor-parallel ones
(their norms summed over the tensor group), ZeRO-sharded ones (summed over the data group) and the rest, counted on
the rank alone. Expert-parallel experts, which carry ``moe_info`` and live on one rank each, fall into the rest: each
rank added its own experts' squares to the replicated layers' and clipped with that norm. The reporter points out that
the experts' norms must be summed like any other model parallelism, else different ranks compute different norms and
clip the same replicated gradients by different factors; a maintainer confirmed and said the collection of the
experts' gradients would be added, and the issue was closed for inactivity with no fix named. The row's fix sums the
experts' squares over the expert-parallel group before adding them. Here the 4 experts of ``field_moe_vectors`` live
two to a rank on 2 gloo ranks, the replicated layers' gradients averaged over the ranks (ColossalAI's MoE gradient
handler), and ``max_norm`` is below the gradient norm at both steps.
"""

import functools

import torch
import torch.distributed as dist

from equivcheck.suites.field import Bug
from equivcheck_cases.field._clipping import (MAX_NORM, ep_group, expert_parallel, expert_parallel_check,
                                              expert_parallel_step)
from equivcheck_cases.field._references import clipped_once

BUG = Bug("hpcaitech/ColossalAI", "issue", 2192, "clipping",
          "clip_grad_norm_fp32 counted EP experts' norms on their own rank only: ranks clipped differently",
          fixed_by="open; none landed (closed stale); the row's fix sums the experts' squares over the EP group",
          fix_acts="gradient")


def parallelize(model, mesh):
    """The experts over the EP group, each parameter carrying ``moe_info`` as ColossalAI's ``MoeExperts`` sets it."""
    return expert_parallel(model, mesh, moe_info="ep_size_2")


def is_moe_param(parameter):
    return hasattr(parameter, "moe_info")


def clip_grad_norm_fp32(parameters, max_norm, experts_summed=True):
    """ColossalAI's clip, no tensor parallelism and no ZeRO shard: every gradient's squares counted on this rank.
    ``experts_summed``: the experts' squares kept apart and summed over the expert-parallel group first."""
    params = [p for p in parameters if p.grad is not None]
    no_tensor_parallel_grads = [p.grad for p in params if not (experts_summed and is_moe_param(p))]
    moe_grads = [p.grad for p in params if experts_summed and is_moe_param(p)]
    no_tensor_parallel_norm = sum((torch.norm(g, 2.0) ** 2.0 for g in no_tensor_parallel_grads), torch.zeros(()))
    if experts_summed:
        moe_norm = sum((torch.norm(g, 2.0) ** 2.0 for g in moe_grads), torch.zeros(()))
        dist.all_reduce(moe_norm, group=ep_group())
        no_tensor_parallel_norm = no_tensor_parallel_norm + moe_norm
    total_norm = no_tensor_parallel_norm ** (1.0 / 2.0)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in params:
            p.grad.detach().mul_(clip_coeff)
    return total_norm


def clip(model, experts_summed=True):
    return clip_grad_norm_fp32(model.parameters(), MAX_NORM, experts_summed)


def train_step(model, optimizer, batch):
    return expert_parallel_step(model, optimizer, batch, clip)


def train_step_as_reported(model, optimizer, batch):
    return expert_parallel_step(model, optimizer, batch, functools.partial(clip, experts_summed=False))


clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return expert_parallel_check(train_step_as_reported, clip_once_with_the_global_norm, parallelize)


def fixed():
    return expert_parallel_check(train_step, clip_once_with_the_global_norm, parallelize)
