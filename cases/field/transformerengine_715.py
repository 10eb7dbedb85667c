"""ROCm/TransformerEngine#715: a replicated TE Linear marked tensor-parallel: Megatron's clip norm counted it TP times.

Transformer Engine's ``Linear`` set ``tensor_model_parallel`` on every weight, including the replicated ones built
with ``parallel_mode=None`` (what Megatron's ``"duplicated"`` layers, such as MLA's down projections, map to).
Megatron's gradient norm for clipping counts a parameter so marked on every TP rank (a shard each) and any other on
TP rank 0 only, so each replicated weight's squared gradient entered the global norm ``tp_size`` times: the pull
measured norms 1.36x and 1.52x too large on MLA models at TP=8. Whenever the norm exceeded ``--clip-grad`` the
gradients were scaled by ``max_norm / norm`` with that inflated norm, clipped harder than one process clipping the
same gradient with its true norm. The fix (pull #715) marks a weight tensor-parallel only when ``parallel_mode`` shards
it. Here the team's Megatron-style attention block (``_tensor.SinkAttention``) takes its replicated input projection
as a TE ``Linear(parallel_mode=None)`` and runs TP on 2 ranks with Megatron's clip; its shards are DTensors read back
through ``full_tensor()``, its replicated weights plain tensors. The reference clips the full batch's gradient once
with ``torch.nn.utils.clip_grad_norm_``.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import clipped_token_step, megatron_clipped_step, sink_attention_tensor_parallel

BUG = Bug("ROCm/TransformerEngine", "pull", 715, "tensor",
          "replicated TE Linear marked tensor-parallel: its grad counted TP times in the clip norm",
          fix_acts="gradient")

MAX_NORM = 1.0  # below field_sink_attention's gradient norm at every step (2.2 to 4.0): clipping engages

clip_once_with_the_global_norm = clipped_token_step(MAX_NORM)


def train_step(model, optimizer, batch):
    return megatron_clipped_step(model, optimizer, batch, MAX_NORM)


def tensor_parallel(model, mesh):
    return sink_attention_tensor_parallel(model, mesh, down_proj_marked=False)


def tensor_parallel_as_reported(model, mesh):
    return sink_attention_tensor_parallel(model, mesh, down_proj_marked=True)


def buggy():
    return ec.check_step("field_sink_attention", train_step, clip_once_with_the_global_norm, mesh={"tp": 2},
                         parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_sink_attention", train_step, clip_once_with_the_global_norm, mesh={"tp": 2},
                         parallelize=tensor_parallel)
