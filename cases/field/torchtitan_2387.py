"""pytorch/torchtitan#2387: under TP the MoE router's gradient was a partial sum taken as whole: its copies diverged.

torchtitan replicates the router's gate on every TP rank (``NoParallel``), whose output is taken local with
``to_local()``, its gradient assumed Replicate. With the scores applied after the experts
(``score_before_experts=False``) the routed outputs they multiply are the row-wise experts' partial sums, reduced
only at the MoE layer's boundary, so the gradient of the scores on each rank is a partial sum too; nothing reduced
it, and the gate's copies stepped with different partial gradients and diverged from the first step (the report:
"the weight diverges right after the first step among different TP ranks"), where one process uses the whole. Pull
#1878's fix for the experts' input (pytorch/torchtitan#1805) does not reach this path. The fix checked here is the
issue's own one line (pull #2388 proposed the same and was closed unmerged): ``NoParallel`` takes the gate's output
local with ``to_local(grad_placements=(Partial(),))``, so DTensor all-reduces its gradient in backward. It is not
the fix torchtitan merged: pull #2416 also undid #1878's change and moved the reduction to the MoE layer's boundary,
which this row does not reproduce. Here the model of ``torchtitan_1805`` with the scores applied after the experts
runs torchtitan's MoE plan (no EP, no SP, #1878's fix in place) on 2 ranks; the sharded experts and the replicated
gate are DTensors, the input projection and the head plain tensors every rank holds.
"""

from torch.distributed.tensor import Partial

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import NoParallel, TensorParallel, moe_tensor_parallel, token_mean_step

BUG = Bug("pytorch/torchtitan", "issue", 2387, "tensor",
          "MoE router output to_local() without a Partial grad: router grads never reduced, copies diverge",
          fixed_by="the issue's one-line annotation (as pull #2388); the merged pull #2416 differs",
          fix_acts="communication moe.router.gate")


def tensor_parallel(model, mesh):
    return moe_tensor_parallel(model, mesh, TensorParallel(), NoParallel(local_output_grad_placements=(Partial(),)))


def tensor_parallel_as_reported(model, mesh):
    return moe_tensor_parallel(model, mesh, TensorParallel(), NoParallel())


def buggy():
    return ec.check_step("field_moe_scores_after", token_mean_step, mesh={"tp": 2},
                         parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_moe_scores_after", token_mean_step, mesh={"tp": 2}, parallelize=tensor_parallel)
