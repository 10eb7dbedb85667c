"""NVIDIA/Megatron-LM#7452: GatedDeltaNet's out_norm, shared by all heads, was summed over TP only under SP.

The report (finding 11 of an audit that found a dozen silent parallelism bugs, each reproduced on CPU with gloo
ranks) is about Megatron Core's GatedDeltaNet under tensor parallelism: its input projection is column-parallel, so
each TP rank holds its own heads, and ``_apply_gated_norm`` normalises every head with one ``out_norm`` (an RMSNorm
over the head dimension, its weight replicated on every rank) and gates it with ``silu(z)`` before the row-parallel
output projection. The weight's gradient on a rank is the sum over that rank's heads only, a partial sum, but the
gradient finalizer (``_allreduce_layernorm_grads``) all-reduces norm weights over the TP group only when sequence
parallelism (or QK layernorm) is on: without SP the two copies stepped with different halves of the gradient (the
report measured ``[0.1200, 0.0400]`` and ``[0.0197, -0.0077]`` against the complete ``[0.1397, 0.0323]``) and
drifted apart. The fix the report proposes marks ``out_norm.weight`` for a TP gradient sum whether or not SP is on.
Here the team's block (in projection into per-head values and gates, the gated out_norm, the output projection, then
a per-token head; the recurrent delta-rule core, per head and with no parameters of its own here, is left out) runs
on 2 ranks with SP off. The projections' shards are DTensors read back through ``full_tensor()``; out_norm and the
head are plain.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import (
    CLASSES, FEATURES, CopyToTensorParallelRegion, ReduceFromTensorParallelRegion, local, shard_, token_case,
    token_step,
)

BUG = Bug("NVIDIA/Megatron-LM", "issue", 7452, "tensor",
          "GDN's shared out_norm weight (heads TP-sharded) summed over TP only when SP was on: copies drift",
          fix_acts="communication out_norm")

HEADS, HEAD_DIM = 2, 4


class GatedNormBlock(nn.Module):
    """x + out_proj(out_norm(v) * silu(z)) per head, then a per-token head. ``in_proj`` rows are grouped by head
    ([v, z] of head 0, then of head 1), so sharding them in two gives each rank its own head, as Megatron lays them."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(FEATURES, HEADS * 2 * HEAD_DIM, bias=False)
        self.out_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.out_proj = nn.Linear(HEADS * HEAD_DIM, FEATURES, bias=False)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.tp_group = None
        with torch.no_grad():
            self.out_norm.weight.uniform_(0.5, 1.5)

    def gated_norm(self, projected):
        """``_apply_gated_norm``: every local head normalised by the one out_norm, then gated."""
        v, z = projected.unflatten(-1, (-1, 2, HEAD_DIM)).unbind(-2)
        return (self.out_norm(v) * F.silu(z)).flatten(-2)

    def forward(self, x):
        if self.tp_group is None:
            mixed = self.out_proj(self.gated_norm(self.in_proj(x)))
        else:  # column-parallel in (its input's gradient all-reduced), row-parallel out (its output all-reduced)
            projected = F.linear(CopyToTensorParallelRegion.apply(x, self.tp_group), local(self.in_proj.weight))
            partial = F.linear(self.gated_norm(projected), local(self.out_proj.weight))
            mixed = ReduceFromTensorParallelRegion.apply(partial, self.tp_group)
        return self.head(x + mixed)


gated_norm_block = ec.register_case(token_case(
    "field_gated_norm_block", GatedNormBlock,
    "in projection to 2 heads of (value, gate), a shared gated RMSNorm, output projection, per-token head"))


def tensor_parallel(model, mesh, mark_out_norm=True):
    """Megatron's layers on mesh['tp'], sequence parallelism off; the fix flags out_norm for a TP gradient sum."""
    shard_(model.in_proj, "weight", mesh["tp"], 0)
    shard_(model.out_proj, "weight", mesh["tp"], 1)
    model.tp_group = mesh["tp"].get_group()
    model.sequence_parallel = False
    model.out_norm.weight.sum_over_tp = mark_out_norm
    return model


def tensor_parallel_as_reported(model, mesh):
    return tensor_parallel(model, mesh, mark_out_norm=False)


def finalize_model_grads(model):
    """The finalizer's norm pass: as reported it summed flagged norms over TP under SP only; the fix also sums
    out_norm's weight, flagged for a TP sum whether or not SP is on."""
    for parameter in model.parameters():
        under_sp = model.sequence_parallel and getattr(parameter, "sequence_parallel", False)
        if under_sp or getattr(parameter, "sum_over_tp", False):
            dist.all_reduce(parameter.grad, group=model.tp_group)


def train_step(model, optimizer, batch):
    return token_step(model, optimizer, batch, finalize_model_grads)


def buggy():
    return ec.check_step("field_gated_norm_block", train_step, mesh={"tp": 2}, parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_gated_norm_block", train_step, mesh={"tp": 2}, parallelize=tensor_parallel)
