"""pytorch/torchtitan#1805: MoE experts under TP ran on plain local shards; their input's gradient was never summed.

torchtitan's ``TensorParallel`` style for the routed experts shards w1 and w3 column-wise and w2 row-wise, and
``GroupedExperts`` multiplies with ``to_local()`` views of them (plain tensors, for the dynamic shapes of routing).
Every TP rank sees the same routed tokens, each with its own slice of the experts' hidden units, so the gradient
flowing back into the routed input is a partial sum over that slice; with plain tensors nothing tells autograd to
reduce it, so each rank sent its own partial gradient back into the router and everything before the MoE layer,
where one process sends the whole. The fix (pull #1878) wraps the routed input at the experts' boundary as a
Replicate DTensor and takes it local again with ``grad_placements=(Partial(),)``, which inserts the all-reduce in
backward. Here a tiny model (input projection, a top-1 MoE of 2 SwiGLU experts with torchtitan's router, reorderer
and for-loop experts, scores applied before the experts as by default, a per-token head) runs torchtitan's MoE plan
(no EP, no SP) on 2 ranks through ``parallelize_module``; the sharded experts and the replicated gate are DTensors,
the input projection and the head plain tensors every rank holds.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import NoParallel, TensorParallel, moe_tensor_parallel, token_mean_step

BUG = Bug("pytorch/torchtitan", "issue", 1805, "tensor",
          "MoE experts TP on to_local() shards: routed input's grad a partial sum, never all-reduced",
          fixed_by="pull #1878", fix_acts="communication moe.experts")


def tensor_parallel(model, mesh):
    return moe_tensor_parallel(model, mesh, TensorParallel(partial_input_grad=True), NoParallel())


def tensor_parallel_as_reported(model, mesh):
    return moe_tensor_parallel(model, mesh, TensorParallel(partial_input_grad=False), NoParallel())


def buggy():
    return ec.check_step("field_moe_scores_before", token_mean_step, mesh={"tp": 2},
                         parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_moe_scores_before", token_mean_step, mesh={"tp": 2}, parallelize=tensor_parallel)
