"""deepspeedai/DeepSpeed#1252: ZeRO-2's CPU-offload gradient norm counted a pipeline-tied weight on every stage.

A DeepSpeed ``PipelineModule`` with a ``TiedLayerSpec`` (an embedding tied to the output layer) builds the tied module
on every stage that uses it, all-reduces the copies' gradients over the tie group (``allreduce_tied_weight_gradients``)
and marks the copies on every rank but the tie's first one ``ds_pipe_replicated``, so that norms count the weight
once. ZeRO stage 2 with ``cpu_offload`` computed its norm in ``complete_grad_norm_calculation_for_cpu_offload``, which
summed the squares of every parameter it held, then all-reduced the sum over the data-parallel and the model-parallel
(pipe x tensor) groups: the last stage's replicated copy entered the sum beside the first stage's, the tied weight was
counted twice, and the offloaded path clipped harder than one process would. The pull (merged) skips parameters
marked ``ds_pipe_replicated`` in that loop, as DeepSpeed's other norms already did ("Pipeline parallelism may
replicate parameters. Avoid multi-counting."). Here ``field_tied_lm`` runs as two GPipe stages on 2 gloo ranks (DP=1:
the ZeRO partition is the whole stage), the offloaded partition's norms taken per parameter as the offload path takes
them, and ``max_norm`` is below the gradient norm at both steps.
"""

import functools

import torch
import torch.distributed as dist

from equivcheck.suites.field import Bug
from equivcheck_cases.field._clipping import clipped_tied_full_batch, tied_pipeline_check, tied_pipelined_step

BUG = Bug("deepspeedai/DeepSpeed", "pull", 1252, "clipping",
          "ZeRO-2 CPU-offload grad norm counted ds_pipe_replicated tied weights once per pipeline stage",
          fix_acts="gradient")

MAX_NORM = 1.0  # below field_tied_lm's gradient norm at both steps (7.1, then 5.6): clipping engages
TIED_RANKS = (0, 1)  # the stages that hold the tied embedding: the first and the last


def mark_pipe_replicated(stage_module, model):
    """``PipelineModule._index_tied_modules``: only count the tied module once, so its copies on every rank of the
    tie but the first are ``ds_pipe_replicated``."""
    if dist.get_rank() != TIED_RANKS[0]:
        for p in (model.head.weight,):
            p.ds_pipe_replicated = True


def complete_grad_norm_calculation_for_cpu_offload(params, norm_for_param_grads, skip_replicated=True):
    """The offloaded partition's norm: each parameter's gradient norm squared and summed, all-reduced over the
    data-parallel group (one rank) and the model-parallel group (the pipeline's two stages), then the root.
    ``skip_replicated`` (the pull): parameters the pipeline replicated are left out."""
    total_norm = torch.zeros((), dtype=torch.float64)
    for p in params:
        if skip_replicated and getattr(p, "ds_pipe_replicated", False):
            continue
        total_norm += norm_for_param_grads[id(p)] ** 2
    dist.all_reduce(total_norm)  # dp_process_group is this rank alone; the model-parallel group is both stages
    return total_norm ** 0.5


def unscale_and_clip_grads(params, total_norm, clip_grad, loss_scale=1.0):
    combined_scale = loss_scale
    clip = ((total_norm / loss_scale) + 1e-6) / clip_grad
    if clip > 1:
        combined_scale = clip * loss_scale
    for p in params:
        p.grad.mul_(1.0 / combined_scale)


def zero2_offload_step(stage_module, model, skip_replicated=True):
    """ZeRO-2 with ``cpu_offload`` on this stage: the partition's per-parameter gradient norms, the total, the clip."""
    mark_pipe_replicated(stage_module, model)
    params = [p for p in stage_module.parameters() if p.grad is not None]
    norm_for_param_grads = {id(p): p.grad.detach().double().norm(2) for p in params}
    total_norm = complete_grad_norm_calculation_for_cpu_offload(params, norm_for_param_grads, skip_replicated)
    unscale_and_clip_grads(params, total_norm, MAX_NORM)


def train_step():
    return tied_pipelined_step(zero2_offload_step)


def train_step_as_reported():
    return tied_pipelined_step(functools.partial(zero2_offload_step, skip_replicated=False))


clip_once_with_the_global_norm = clipped_tied_full_batch(MAX_NORM)


def buggy():
    return tied_pipeline_check(train_step_as_reported, clip_once_with_the_global_norm)


def fixed():
    return tied_pipeline_check(train_step, clip_once_with_the_global_norm)
