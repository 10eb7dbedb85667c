"""NVIDIA/Megatron-LM#7227: under PP, Megatron-FSDP v2 counted both copies of the tied embedding in the clip norm.

With pipeline parallelism a language model's tied input embedding and output layer live on different stages, so
Megatron keeps two parameters: the first stage's embedding and a copy on the last stage, which ``LanguageModule``
marks ``shared = True``, and ``finalize_model_grads`` all-reduces their gradients so both hold the sum. Megatron's
gradient norm skips the marked copy (``param_is_not_shared``); Megatron-FSDP v2's ``FullyShardedOptimizer``
(``get_grad_norm``, ``count_zeros``) dropped the attribute when it made its sharded parameters and summed every
optimizer parameter, so the tied weight's squares counted twice and every gradient was over-clipped. The pull's
two-rank regression (PP=2, DP=1) measures 40 (sqrt(1600)) instead of 28.284 (sqrt(800)); the closed sibling pull
#7228 notes that Megatron-FSDP v2 still rejects PP on main, so the fault is latent there. The fix (open) keeps
``shared`` on the sharded parameters and applies MCore's shared-parameter filter in the norm. Here ``field_tied_lm``
runs as two GPipe stages on 2 gloo ranks (DP=1, no shard to split), and ``max_norm`` is below the gradient norm at
both steps.
"""

import functools

import torch
import torch.distributed as dist

from equivcheck.suites.field import Bug
from equivcheck_cases.field._clipping import clipped_tied_full_batch, tied_pipeline_check, tied_pipelined_step

BUG = Bug("NVIDIA/Megatron-LM", "pull", 7227, "clipping",
          "MFSDP v2 under PP: the last stage's copy of the tied embedding counted in the clip norm too",
          fixed_by="pull #7227 (open)", fix_acts="gradient")

MAX_NORM = 1.0  # below field_tied_lm's gradient norm at both steps (7.1, then 5.6): clipping engages


def param_is_not_shared(param):
    return not getattr(param, "shared", False)


def mark_last_stage_copy(stage_module, model):
    """``LanguageModule.setup_embeddings_and_output_layer``: with PP > 1 the last stage's output weight is the copy,
    marked ``shared``."""
    if dist.get_rank() == dist.get_world_size() - 1:
        model.head.weight.shared = True


def get_grad_norm(parameters, shared_filtered=True):
    """``FullyShardedOptimizer.get_grad_norm``: each gradient's squares (over its replication count: one at DP=1),
    summed over the gradient-statistics group (the world). ``shared_filtered`` (pull #7227):
    ``_filter_params_for_norm`` first, so the tied weight's last-stage copy is left out."""
    parameters = [p for p in parameters if p.grad is not None]
    if shared_filtered:
        parameters = [p for p in parameters if param_is_not_shared(p)]
    total = torch.zeros((), dtype=torch.float64)
    for p in parameters:
        total += p.grad.detach().square().sum()
    dist.all_reduce(total)
    return total.sqrt()


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm):
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coefficient)


def clip_grad_norm(stage_module, model, shared_filtered=True):
    mark_last_stage_copy(stage_module, model)
    parameters = list(stage_module.parameters())
    clip_grad_by_total_norm_fp32(parameters, MAX_NORM, get_grad_norm(parameters, shared_filtered))


def train_step():
    return tied_pipelined_step(clip_grad_norm)


def train_step_as_reported():
    return tied_pipelined_step(functools.partial(clip_grad_norm, shared_filtered=False))


clip_once_with_the_global_norm = clipped_tied_full_batch(MAX_NORM)


def buggy():
    return tied_pipeline_check(train_step_as_reported, clip_once_with_the_global_norm)


def fixed():
    return tied_pipeline_check(train_step, clip_once_with_the_global_norm)
