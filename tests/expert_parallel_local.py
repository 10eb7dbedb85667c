"""A team's expert parallelism with Megatron's local numbering, imported by name on the ranks
(tests/test_expert_parallel.py): four experts, each rank of ``ep`` holding ``experts`` as a ModuleList of its own
``4 / ep`` only, numbered from 0 on every rank (rank 1 of ep=2 holds the case's experts 2 and 3 as its 0 and 1).
Its ``parallelize`` returns ``(model, names)``: this rank's parameter names to the single-process model's. Tokens go
to their expert's rank and back with ``all_to_all_single``, their expert's number with them; the router and the head
are replicated, their gradients all-reduced by the team, an expert's summed over its replicas (``dp``)."""

import functools

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
import expert_parallel

EXPERTS = 4


class RoutedMLP(expert_parallel.RoutedMLP):
    """Top-1 routing over four experts: each token through the expert its router picks, scaled by its probability."""

    def __init__(self) -> None:
        super().__init__(EXPERTS)

    def through_experts(self, x, chosen, first):
        """Each token through its expert, numbered ``first`` on in this rank's ``experts``."""
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            picked = chosen == first + index
            out = out.index_put((picked,), expert(x[picked]))
        return out


CASE = ec.Case(name="ep_local_experts", model=RoutedMLP, data=lambda: (torch.randn(32, 6), torch.randint(0, 3, (32,))),
               loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=16, steps=2,
               description="top-1 routing over four experts, numbered locally on each expert-parallel rank")

_ep = _dp = None  # the ep dimension's process group (None: no ep dimension) and the dp one, set by parallelize


def _ep_rank_size():
    return (0, 1) if _ep is None else (dist.get_rank(_ep), dist.get_world_size(_ep))


def parallelize(model, mesh):
    """This rank keeps its own experts, renumbered from 0; the names say which of the case's each one is."""
    global _ep, _dp
    _ep = mesh["ep"].get_group() if "ep" in mesh.mesh_dim_names else None
    _dp = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
    rank, size = _ep_rank_size()
    per_rank = EXPERTS // size
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    model.experts = nn.ModuleList(model.experts[index] for index in mine)
    names = {f"experts.{local}.{kind}": f"experts.{index}.{kind}"
             for local, index in enumerate(mine) for kind in ("weight", "bias")}
    return model, names


def expert_parallel_forward(model, x):
    rank, size = _ep_rank_size()
    per_rank = EXPERTS // size
    chosen, gate = model.route(x)
    if _ep is None:
        return model.head(torch.tanh(model.through_experts(x, chosen, first=0)) * gate)
    order = torch.argsort(chosen, stable=True)
    sending = torch.bincount(chosen // per_rank, minlength=size)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=_ep)
    sending, receiving = sending.tolist(), receiving.tolist()
    experts = torch.empty(sum(receiving), dtype=chosen.dtype)
    dist.all_to_all_single(experts, chosen[order], receiving, sending, group=_ep)
    arrived = distributed.all_to_all_single(x.new_empty(sum(receiving), x.shape[1]), x[order], receiving, sending,
                                            group=_ep)
    done = model.through_experts(arrived, experts, first=rank * per_rank)
    back = distributed.all_to_all_single(x.new_empty(len(x), x.shape[1]), done, sending, receiving, group=_ep)
    out = torch.empty_like(back).index_copy(0, order, back)
    return model.head(torch.tanh(out) * gate)


def _step(model, optimizer, batch, experts_over_ep=False, experts_over_dp=True):
    losses = expert_parallel.backward_shard(model, optimizer, batch, expert_parallel_forward)
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        if name.startswith("experts."):  # whole on its ep rank: summed over its replicas (dp)
            if experts_over_dp and _dp is not None:
                dist.all_reduce(parameter.grad, group=_dp)
            if experts_over_ep:  # the bug: averaged over ep once more
                parameter.grad /= _ep_rank_size()[1]
        else:  # the router and the head: every rank's tokens
            dist.all_reduce(parameter.grad)
    optimizer.step()
    return losses.mean().detach()


def step(model, optimizer, batch):
    return _step(model, optimizer, batch)


step_experts_averaged = functools.partial(_step, experts_over_ep=True)
step_experts_not_summed_over_dp = functools.partial(_step, experts_over_dp=False)
