"""huggingface/transformers#48687: under expert parallelism batched_mm gave the router gradient for unrouted slots.

transformers builds expert parallelism on its tensor-parallel mesh: every rank of the group sees the same tokens,
holds ``num_experts / ep`` experts, and the router's output hook (``RouterParallel``) remaps every slot routed to
another rank's expert to a sentinel id and zeroes its routing weight; the experts' outputs are summed over the group,
and (since pull #48205) so are the router's per-rank partial gradients. ``batched_mm`` computes an output for every
slot, the sentinel ones included (their id clamped to a local expert), and multiplies it by the routing weight: zero in
the forward, but the backward hands that weight the product of the output's gradient with the sentinel slot's
non-zero expert output, and the router collected gradient for slots the rank never routed. The loss was right and
only the router's gradient wrong. The fix (pull #48689) masks the sentinel slots' routing weights in the experts'
forward, which the backward sees. Here the hook's zeroing is written so that autograd does not see it (in place,
under ``no_grad``): the arithmetic the report describes, a zero weight in the forward that still passes a gradient.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import (IN, CopyToParallel, ReduceFromParallel, experts_per_rank, gather_experts,
                                         group, remember)

BUG = Bug("huggingface/transformers", "issue", 48687, "moe",
          "EP + batched_mm: sentinel slots' zero routing weight still passed the router a gradient",
          fixed_by="pull #48689", fix_acts="backward experts")


def parallelize(model, mesh):
    return remember(model, mesh, "tp")


def gather(name, local):
    return gather_experts(name, local)


def batched_mm_experts_forward(model, hidden, top_k_index, top_k_weights, mask_sentinels):
    """This rank's experts on every slot; a slot routed elsewhere carries the sentinel id ``per_rank``."""
    per_rank, rank = experts_per_rank(), dist.get_rank(group())
    sentinel = top_k_index == per_rank
    hidden = CopyToParallel.apply(hidden)
    outputs = torch.stack([model.experts[rank * per_rank + j](hidden) for j in range(per_rank)], dim=1)
    clamped = top_k_index.clamp(max=per_rank - 1)  # the sentinel reads a local expert: a real, non-zero output
    proj_out = outputs.gather(1, clamped[..., None].expand(-1, -1, IN))
    if mask_sentinels:  # the fix: the backward sees the zero
        top_k_weights = top_k_weights.masked_fill(sentinel, 0.0)
    return ReduceFromParallel.apply((top_k_weights[..., None] * proj_out).sum(1))


def forward(model, x, mask_sentinels):
    hidden = torch.tanh(model.trunk(x))
    top_k_index, top_k_weights = model.route(hidden)
    per_rank, rank = experts_per_rank(), dist.get_rank(group())
    # RouterParallel's output hook: slots routed to another rank's experts get the sentinel id and weigh nothing.
    local = top_k_index // per_rank == rank
    top_k_index = torch.where(local, top_k_index % per_rank, per_rank)
    with torch.no_grad():
        top_k_weights.masked_fill_(~local, 0.0)
    top_k_weights = CopyToParallel.apply(top_k_weights)  # pull #48205: the router's partial gradients summed
    return model.head(hidden + batched_mm_experts_forward(model, hidden, top_k_index, top_k_weights, mask_sentinels))


def train_step(model, optimizer, batch, mask_sentinels=True):
    inputs, labels = batch
    loss = F.cross_entropy(forward(model, inputs, mask_sentinels), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, mask_sentinels=False)


def buggy():
    return ec.check_step("field_moe_vectors", train_step_as_reported, mesh={"tp": 2}, parallelize=parallelize,
                         gather=gather)


def fixed():
    return ec.check_step("field_moe_vectors", train_step, mesh={"tp": 2}, parallelize=parallelize, gather=gather)
