"""NVIDIA/Megatron-LM#619: under TP + SP the SwitchMLP router's gradients were never summed over the TP group.

Megatron's legacy ``SwitchMLP`` routes each token to one expert with a router built as a plain ``torch.nn.Linear``.
With sequence parallelism every TP rank runs the router on its own chunk of the sequence, so the router's gradient
on a rank is the sum over that chunk only; the gradient finalizer adds the chunks up for parameters marked
``sequence_parallel`` (the norms), and the router's weights carried no such mark. Each TP rank stepped its copy with
its own chunk's gradient and the copies drifted apart, the divergence issue #599 reported (routers of one TP group
with different weights, which could then not be exported). The pull, closed unmerged, marks the router's weights
``sequence_parallel`` when ``config.sequence_parallel`` is set, so they are all-reduced with the norms. Here the
team's Megatron-style block (a pre-norm, a top-1 SwitchMLP of 2 experts, each column- then row-parallel over the
gathered sequence, a residual and a replicated per-token head) runs with SP on 2 TP ranks, its expert shards DTensors
read back through ``full_tensor()``, the norm, router and head plain tensors every rank holds.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import (
    CLASSES, FEATURES, HIDDEN, GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion,
    ScatterToSequenceParallelRegion, local, shard_, token_case, token_step,
)

BUG = Bug("NVIDIA/Megatron-LM", "pull", 619, "tensor",
          "TP + SP: SwitchMLP router (a plain Linear) lacked the sequence_parallel mark: grads never summed",
          fixed_by="the pull's own change (closed unmerged; reported as issue #599)",
          fix_acts="communication router")

EXPERTS = 2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, FEATURES, bias=False)


class SwitchBlock(nn.Module):
    """x + SwitchMLP(norm(x)), then a per-token head. Every expert runs on every token and the router's top-1 mask
    keeps its own tokens: the values and gradients of SwitchMLP's per-expert token selection."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.router = nn.Linear(FEATURES, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.head = nn.Linear(FEATURES, CLASSES)
        self.tp_group = None
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
            self.router.weight.mul_(3)

    def route(self, h):
        route = F.softmax(self.router(h), dim=-1)
        max_prob, max_ind = torch.max(route, dim=-1)
        return max_prob.unsqueeze(-1), max_ind

    def forward(self, x):
        if self.tp_group is not None:
            return self.megatron_forward(x)
        h = self.norm(x)
        max_prob, max_ind = self.route(h)
        out = sum((max_ind == e).unsqueeze(-1) * expert.fc2(F.gelu(expert.fc1(h)))
                  for e, expert in enumerate(self.experts))
        return self.head(x + out * max_prob)

    def megatron_forward(self, x):
        """On [sequence, batch, hidden]: this rank's chunk of the sequence through the norm and the router, the
        gathered sequence through each expert's column- and row-parallel layers, reduce-scattered back."""
        group = self.tp_group
        x = ScatterToSequenceParallelRegion.apply(x.transpose(0, 1).contiguous(), group)
        h = self.norm(x)
        max_prob, max_ind = self.route(h)
        gathered = GatherFromSequenceParallelRegion.apply(h, group, True)
        out = 0
        for e, expert in enumerate(self.experts):
            inner = F.gelu(F.linear(gathered, local(expert.fc1.weight), local(expert.fc1.bias)))
            expert_out = ReduceScatterToSequenceParallelRegion.apply(F.linear(inner, local(expert.fc2.weight)), group)
            out = out + (max_ind == e).unsqueeze(-1) * expert_out
        hidden = GatherFromSequenceParallelRegion.apply(x + out * max_prob, group, False)
        return self.head(hidden).transpose(0, 1)


switch_block = ec.register_case(token_case(
    "field_switch_block", SwitchBlock,
    "pre-norm, top-1 SwitchMLP of 2 GELU experts behind a linear router, residual, per-token head, (12, 8, 8)"))


def sequence_parallel(model, mesh, mark_router=True):
    """Megatron's layers on mesh['tp'] with SP: each expert's fc1 column-parallel, fc2 row-parallel; the norm's
    parameters marked ``sequence_parallel``, and (the pull) the router's too."""
    tp = mesh["tp"]
    for expert in model.experts:
        shard_(expert.fc1, "weight", tp, 0)
        shard_(expert.fc1, "bias", tp, 0)
        shard_(expert.fc2, "weight", tp, 1)
    model.tp_group = tp.get_group()
    for parameter in model.norm.parameters():
        parameter.sequence_parallel = True
    if mark_router:
        for parameter in model.router.parameters():
            parameter.sequence_parallel = True
    return model


def sequence_parallel_as_reported(model, mesh):
    return sequence_parallel(model, mesh, mark_router=False)


def allreduce_sequence_parallel_grads(model):
    """The finalizer's pass: the gradients of the parameters marked ``sequence_parallel`` summed over TP."""
    for parameter in model.parameters():
        if getattr(parameter, "sequence_parallel", False):
            dist.all_reduce(parameter.grad, group=model.tp_group)


def train_step(model, optimizer, batch):
    return token_step(model, optimizer, batch, allreduce_sequence_parallel_grads)


def buggy():
    return ec.check_step("field_switch_block", train_step, mesh={"tp": 2}, parallelize=sequence_parallel_as_reported)


def fixed():
    return ec.check_step("field_switch_block", train_step, mesh={"tp": 2}, parallelize=sequence_parallel)
