"""huggingface/transformers#46113: the native FSDP+TP clip handed gradients where parameters go, so nothing was clipped.

transformers' ``clip_grad_norm`` for its native FSDP + tensor-parallel path (pull #45028) collects ``grads = [p.grad
for p in parameters]``, replicates every DTensor gradient to a whole local copy to take the norm, and calls
``torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total_norm)``. That function takes parameters and scales each
one's ``.grad``; a gradient tensor's own ``.grad`` is None, so the list it scales is empty and it returns without a
word: the reported norm is right and no gradient is ever clipped, ``max_norm`` ignored. The pull (open) also measures
the replication's cost (about 60 GB per rank on Qwen3-30B-A3B at tp 8, fsdp 2). Its fix takes the norm from each
rank's local shards, their squares all-reduced over the mesh dimensions the gradient is sharded on, and hands the
parameters to ``clip_grads_with_norm_``. Here ``block_stack`` is FSDP2-sharded over 2 gloo ranks, its gradients
DTensors, and ``max_norm`` is below the gradient norm at every step, so the reference clips every step.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import clipped_once, fully_sharded

BUG = Bug("huggingface/transformers", "pull", 46113, "clipping",
          "FSDP+TP clip_grad_norm passed grads to clip_grads_with_norm_, which reads .grad: nothing clipped",
          fixed_by="pull #46113 (open)", fix_acts="gradient")

MAX_NORM = 0.5  # below block_stack's gradient norm at every step (0.72, then 1.7): clipping engages


def _replicate_dtensor(tensor):
    """A DTensor made whole on every rank (transformers' helper, which also takes _StridedShard)."""
    return tensor.redistribute(placements=[Replicate()] * tensor.device_mesh.ndim)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm, norm_type=2.0, parameters_clipped=True):
    """As reported: the norm of the replicated gradients, and the gradients handed to ``clip_grads_with_norm_``.
    ``parameters_clipped`` (pull #46113): the norm of the local shards, each gradient's p-th power summed over the
    mesh dimensions it is sharded on, and the parameters handed over."""
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not parameters_clipped:
        local_grads = [_replicate_dtensor(g).to_local() if isinstance(g, DTensor) else g for g in grads]
        total_norm = torch.nn.utils.get_total_norm(local_grads, norm_type=norm_type)
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm=max_norm, total_norm=total_norm)
        return total_norm
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local = torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g, norm_type) ** norm_type
        if isinstance(g, DTensor):
            for dim, placement in enumerate(g.placements):
                if placement.is_shard():
                    dist.all_reduce(local, group=g.device_mesh.get_group(dim))
        total += local
    total_norm = total ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm=max_norm, total_norm=total_norm)
    return total_norm


def train_step(model, optimizer, batch, parameters_clipped=True):
    """Each rank's mean loss (FSDP2 averages the shards' gradients), the clip, one step."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    clip_grad_norm(model.parameters(), MAX_NORM, parameters_clipped=parameters_clipped)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, parameters_clipped=False)

clip_once_with_the_global_norm = clipped_once(MAX_NORM)


def buggy():
    return ec.check_step("block_stack", train_step_as_reported, clip_once_with_the_global_norm, world_size=2,
                         wrap=fully_sharded)


def fixed():
    return ec.check_step("block_stack", train_step, clip_once_with_the_global_norm, world_size=2, wrap=fully_sharded)
