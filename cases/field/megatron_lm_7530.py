"""NVIDIA/Megatron-LM#7530: learnable attention sinks, sharded with their heads, were left out of the TP clip norm.

Megatron Core's ``DotProductAttention`` with ``softmax_type="learnable"`` keeps one sink logit per attention head
(``softmax_offset``), sized for this TP rank's heads, so each rank holds a different shard. Its global gradient norm
for clipping (``get_grad_norm_fp32``) counts a parameter on every TP rank when it is marked
``tensor_model_parallel`` and on TP rank 0 only otherwise (``param_is_not_tensor_parallel_duplicate``: a replicated
parameter counted once), and the sinks were never marked: only rank 0's heads' sink gradients entered the norm
(finding 8 of NVIDIA/Megatron-LM#7452). The norm came out too small, and whenever it exceeded ``--clip-grad`` every
gradient was scaled by ``max_norm / norm`` with that too-small norm, clipped less than one process clipping the same
gradient with its true norm. The fix pull #7530 proposes (open, not merged) marks ``softmax_offset`` tensor-parallel
(``partition_dim`` 0) after creating it. Here the team's Megatron-style attention block (``_tensor.SinkAttention``:
a replicated input projection, qkv column-parallel, the sinks with their heads, the output projection row-parallel)
runs TP on 2 ranks with Megatron's clip; its shards are DTensors read back through ``full_tensor()``, its replicated
weights plain tensors. The reference clips the full batch's gradient once with ``torch.nn.utils.clip_grad_norm_``.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import clipped_token_step, megatron_clipped_step, sink_attention_tensor_parallel

BUG = Bug("NVIDIA/Megatron-LM", "pull", 7530, "tensor",
          "TP-sharded attention sinks not marked tensor-parallel: clip norm counted rank 0's sinks only",
          fix_acts="gradient")

MAX_NORM = 1.0  # below field_sink_attention's gradient norm at every step (2.2 to 4.0): clipping engages

clip_once_with_the_global_norm = clipped_token_step(MAX_NORM)


def train_step(model, optimizer, batch):
    return megatron_clipped_step(model, optimizer, batch, MAX_NORM)


def tensor_parallel(model, mesh):
    return sink_attention_tensor_parallel(model, mesh, sink_marked=True)


def tensor_parallel_as_reported(model, mesh):
    return sink_attention_tensor_parallel(model, mesh, sink_marked=False)


def buggy():
    return ec.check_step("field_sink_attention", train_step, clip_once_with_the_global_norm, mesh={"tp": 2},
                         parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_sink_attention", train_step, clip_once_with_the_global_norm, mesh={"tp": 2},
                         parallelize=tensor_parallel)
