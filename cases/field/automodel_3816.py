"""NVIDIA-NeMo/Automodel#3816: with TE experts the clip never summed the experts' norm over the EP axis.

Automodel's sharding-aware clip (``_clip_grad_norm_impl``, called by ``scale_grads_and_clip_grad_norm``) groups the
parameters by their DTensor mesh and placements, sums each group's local squares and all-reduces a DTensor group's
sum over the mesh dimensions it is sharded on; plain tensors form one group counted locally. Transformer Engine's
experts (``GroupedExpertsTE``) are plain tensors, each rank holding its own, so their part of the norm stayed on its
rank: every expert-parallel rank computed its own "global" norm and clipped its shard of the same FSDP-sharded dense
weights by its own factor. The report's 2 gloo ranks print 40.1995 on one and 4.01995 on the other for a true 40.2015,
the same dense parameter clipped 10x differently. Pull #3817 (open) marks the experts by structure (a marker set when
``GroupedExpertsTE`` is built) and sums their group's squares over the EP mesh inside the clip. Here the dense layers
of ``field_moe_vectors`` are FSDP2-sharded over the 2 ranks, the 4 experts plain tensors two to a rank, their
gradients divided by Automodel's EP ratio (the data-parallel size over the ep_shard size: 2), and ``max_norm`` is
below the gradient norm at both steps.
"""

import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from equivcheck.suites.field import Bug
from equivcheck_cases.field._clipping import MAX_NORM, ep_group, expert_parallel_check, expert_parallel_step, is_expert
from equivcheck_cases.field._moe import remember
from equivcheck_cases.field._references import clipped_once

BUG = Bug("NVIDIA-NeMo/Automodel", "issue", 3816, "clipping",
          "TE experts' plain-tensor grads left out of the EP reduction: each EP rank clipped by its own norm",
          fixed_by="pull #3817 (open)", fix_acts="gradient")


def parallelize(model, mesh):
    """FSDP2 over the ranks for the dense layers (trunk, router, head: DTensors sharded on dim 0); the experts, as
    Transformer Engine's grouped experts are, plain tensors on the rank that owns them, marked as pull #3817 marks
    ``GroupedExpertsTE``'s."""
    remember(model, mesh, "ep")
    for layer in (model.trunk, model.router, model.head):
        fully_shard(layer, mesh=mesh["ep"])
    for name, parameter in model.named_parameters():
        if is_expert(name):
            parameter._is_te_grouped_expert = True
    return model


def _clip_grad_norm_impl(parameters, max_norm, ep_reduced=True):
    """Automodel's clip: parameters grouped by (mesh, placements), plain tensors one group; each group's squares
    summed locally and, for a DTensor group, all-reduced over every mesh dimension not Replicate; the groups' norms
    combined; every group clipped with the total. ``ep_reduced`` (pull #3817): the marked experts' group summed over
    the expert-parallel group too."""
    sharding_groups = {}
    for p in parameters:
        if p.grad is None:
            continue
        key = (id(p.device_mesh), tuple(map(str, p.placements))) if isinstance(p, DTensor) else ("regular",)
        sharding_groups.setdefault(key, []).append(p)
    group_norms = []
    for group_params in sharding_groups.values():
        first = group_params[0]
        local_val = sum(((p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().square().sum()
                         for p in group_params), torch.zeros((), dtype=torch.float64))
        if isinstance(first, DTensor):
            for dim_idx, placement in enumerate(first.placements):
                if not isinstance(placement, Replicate):
                    dist.all_reduce(local_val, group=first.device_mesh.get_group(mesh_dim=dim_idx))
        elif ep_reduced and getattr(first, "_is_te_grouped_expert", False):
            dist.all_reduce(local_val, group=ep_group())
        group_norms.append(local_val.sqrt())
    total_norm = torch.stack(group_norms).pow(2).sum().sqrt()
    for group_params in sharding_groups.values():
        torch.nn.utils.clip_grads_with_norm_(group_params, max_norm, total_norm)
    return total_norm


@torch.no_grad()
def scale_grads_and_clip_grad_norm(model, ep_reduced=True):
    """The experts' gradients divided by the EP ratio (data-parallel size 2 over ep_shard size 1), then the clip."""
    ep_ratio = float(dist.get_world_size()) / 1.0
    for name, p in model.named_parameters():
        if p.grad is not None and getattr(p, "_is_te_grouped_expert", False):
            p.grad.div_(ep_ratio)
    return _clip_grad_norm_impl(list(model.parameters()), MAX_NORM, ep_reduced)


def train_step(model, optimizer, batch):
    return expert_parallel_step(model, optimizer, batch, scale_grads_and_clip_grad_norm, reduce=None)


def train_step_as_reported(model, optimizer, batch):
    return expert_parallel_step(model, optimizer, batch,
                                functools.partial(scale_grads_and_clip_grad_norm, ep_reduced=False), reduce=None)


clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return expert_parallel_check(train_step_as_reported, clip_once_with_the_global_norm, parallelize)


def fixed():
    return expert_parallel_check(train_step, clip_once_with_the_global_norm, parallelize)
