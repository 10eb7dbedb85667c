"""pytorch/torchtitan#4054: under TP without EP, gradients below the experts were not all-reduced over TP.

Without expert parallelism torchtitan shards every routed expert's hidden dimension over the TP ranks (the first
projection by its outputs, the second by its inputs) and runs the experts on the replicated tokens inside a
``local_map`` region: each rank's experts produce a partial output, summed over TP on the way out. On the way back,
each rank's gradient with respect to the region's inputs (the tokens and the routing scores) is likewise one part of
a sum. ``set_moe_sharding_config`` computed that layout (``Partial`` on tp) but passed it to ``LocalMapConfig`` only
when EP was on, so ``local_map`` defaulted the inputs' gradient placements to ``Replicate`` and skipped the
all-reduce: every parameter the backward reaches below the experts, the router's gate included, kept one rank's share
of its gradient, while the forward and the loss curves looked right. The fix passes the computed placements without
EP too. Here the region's boundary is written with Megatron's two autograd functions; the second projection's bias is
added once, outside the region.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import EXPERTS, WIDE, CopyToParallel, ReduceFromParallel, group, remember

BUG = Bug("pytorch/torchtitan", "pull", 4054, "moe",
          "TP without EP: the experts' input gradients left Replicate, never all-reduced over TP",
          fix_acts="communication experts")


def parallelize(model, mesh):
    """Each expert's hidden dimension sharded over tp: this rank's rows of the first projection, its columns of the
    second."""
    remember(model, mesh, "tp")
    size, rank = dist.get_world_size(group()), dist.get_rank(group())
    rows = slice(rank * WIDE // size, (rank + 1) * WIDE // size)
    for expert in model.experts:
        up, down = expert[0], expert[2]
        up.weight = nn.Parameter(up.weight.detach()[rows].clone())
        up.bias = nn.Parameter(up.bias.detach()[rows].clone())
        down.weight = nn.Parameter(down.weight.detach()[:, rows].clone())
    return model


def gather(name, local):
    """A sharded expert weight (or gradient) whole: the ranks' shards concatenated; the rest are replicated."""
    if not name.startswith("experts.") or name.endswith("2.bias"):
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group()))]
    dist.all_gather(shards, local.contiguous(), group=group())
    return torch.cat(shards, dim=1 if name.endswith("2.weight") else 0)


def forward(model, x, partial_input_grads):
    hidden = torch.tanh(model.trunk(x))
    chosen, gates = model.route(hidden)
    scores = torch.zeros(len(x), EXPERTS, dtype=x.dtype).scatter(1, chosen, gates)
    # The local_map region's inputs: their gradients Partial over tp (the fix), or Replicate (as reported).
    region_hidden, region_scores = ((CopyToParallel.apply(hidden), CopyToParallel.apply(scores))
                                    if partial_input_grads else (hidden, scores))
    partial = sum(region_scores[:, e : e + 1] * F.linear(torch.tanh(expert[0](region_hidden)), expert[2].weight)
                  for e, expert in enumerate(model.experts))
    routed = ReduceFromParallel.apply(partial) + sum(scores[:, e : e + 1] * expert[2].bias
                                                     for e, expert in enumerate(model.experts))
    return model.head(hidden + routed)


def train_step(model, optimizer, batch, partial_input_grads=True):
    inputs, labels = batch
    loss = F.cross_entropy(forward(model, inputs, partial_input_grads), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, partial_input_grads=False)


def buggy():
    return ec.check_step("field_moe_vectors", train_step_as_reported, mesh={"tp": 2}, parallelize=parallelize,
                         gather=gather)


def fixed():
    return ec.check_step("field_moe_vectors", train_step, mesh={"tp": 2}, parallelize=parallelize, gather=gather)
