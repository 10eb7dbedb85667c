"""A team's own expert parallelism, imported by name on the ranks (tests/test_mesh_team.py): top-1 routing over two
experts, each rank of the ``ep`` dimension holding one expert, tokens sent to their expert's rank and back with
``all_to_all_single``; the router and the head replicated, their gradients all-reduced over ``ep`` by the team.

The case ``ep_experts`` registers here: in one process its model runs every token through the expert its router
picks, scaled by the router's probability, which is what the ranks compute together."""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

EXPERTS = 2


class RoutedMLP(nn.Module):
    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.router = nn.Linear(6, experts)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(experts))
        self.head = nn.Linear(6, 3)

    def route(self, x):
        probabilities = F.softmax(self.router(x), dim=-1)
        chosen = probabilities.argmax(dim=-1)
        return chosen, probabilities.gather(1, chosen[:, None])

    def forward(self, x):
        chosen, gate = self.route(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            picked = chosen == index
            out = out.index_put((picked,), expert(x[picked]))
        return self.head(torch.tanh(out) * gate)


ec.register_case(ec.Case(
    name="ep_experts", model=RoutedMLP, data=lambda: (torch.randn(32, 6), torch.randint(0, 3, (32,))),
    loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=16, steps=2,
    description="top-1 routing over two experts, for expert parallelism on two ranks"))

_group = _replicas = None  # the ep dimension's process group, and the dp one (an expert's replicas), set by parallelize


def parallelize(model, mesh):
    global _group, _replicas
    _group, _replicas = mesh["ep"].get_group(), mesh["dp"].get_group()
    return model


def expert_parallel_forward(model, x):
    """Each token to its expert's rank and back (this rank's expert is the one of its rank in ``ep``)."""
    rank = dist.get_rank(_group)
    chosen, gate = model.route(x)
    order = torch.argsort(chosen, stable=True)
    sending = torch.bincount(chosen, minlength=EXPERTS)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=_group)
    sending, receiving = sending.tolist(), receiving.tolist()
    arrived = distributed.all_to_all_single(x.new_empty(sum(receiving), x.shape[1]), x[order], receiving, sending,
                                            group=_group)
    done = model.experts[rank](arrived)
    back = distributed.all_to_all_single(x.new_empty(len(x), x.shape[1]), done, sending, receiving, group=_group)
    out = torch.empty_like(back).index_copy(0, order, back)
    return model.head(torch.tanh(out) * gate)


def backward_shard(model, optimizer, batch, forward):
    """This rank's shard's losses through ``forward``, their sum over the global batch's count back-propagated."""
    inputs, targets = batch
    optimizer.zero_grad()
    losses = F.cross_entropy(forward(model, inputs), targets, reduction="none")
    (losses.sum() / (len(inputs) * dist.get_world_size())).backward()
    return losses


def _step(model, optimizer, batch, experts_over_ep: bool, dense_reduced: bool):
    losses = backward_shard(model, optimizer, batch, expert_parallel_forward)
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        if name.startswith("experts."):  # whole over ep on its rank: summed over its replicas (dp)
            if dist.get_world_size(_replicas) > 1:
                dist.all_reduce(parameter.grad, group=_replicas)
            if experts_over_ep:  # the bug: averaged over ep once more
                parameter.grad /= dist.get_world_size(_group)
        elif dense_reduced:  # the router and the head: every rank's tokens
            dist.all_reduce(parameter.grad)
    optimizer.step()
    return losses.mean().detach()


def step(model, optimizer, batch):
    return _step(model, optimizer, batch, experts_over_ep=False, dense_reduced=True)


def step_experts_averaged(model, optimizer, batch):
    return _step(model, optimizer, batch, experts_over_ep=True, dense_reduced=True)


def step_dense_unreduced(model, optimizer, batch):
    return _step(model, optimizer, batch, experts_over_ep=False, dense_reduced=False)


def gather(name, local):
    """An expert's weight and gradient are its owner's (rank e of ep for expert e); the rest are replicated."""
    if not name.startswith("experts."):
        return local
    whole = local.detach().clone()
    dist.broadcast(whole, src=dist.get_global_rank(_group, int(name.split(".")[1])), group=_group)
    return whole
