"""Mixtures of experts on ranks: expert parallelism (``ep:world_size=W``), and the pitfalls of the aux terms of a case's
objective (:class:`equivcheck.case.Term`: a load-balancing loss, a router z-loss) normalised wrong across data-parallel
ranks while the main loss is right.

Expert parallelism takes a model that declares its experts: a module holding ``experts`` (an ``nn.ModuleList``) and
``mix(hidden, weights)``, the sum of ``weights[..., e:e+1] * experts[e](hidden)`` over its experts (zero weight: not
chosen). Each of W ranks holds E/W of the experts and its shard of the global batch; its ``mix`` sends each token (with
its weights) to the ranks holding the experts it chose and takes the results back, both by ``all_to_all_single``
(counted as ``all_to_all[ep]``), and back-propagates through them, so an expert's gradient on its rank holds every
rank's tokens. The dense parameters' gradients are summed over the ranks (each rank's loss is its share of the global
objective). Weights and gradients are read back whole from the expert's rank.

DDP averages the ranks' gradients, so a rank's loss is its share of the global objective times the world size
(:meth:`Ddp.rank_part`); teams that add the aux term after that scaling, or scale it again, train the router at
another strength than one process would (Megatron-LM#3672: the global aux loss came out as aux / dp_size;
transformers#48690: the Trainer multiplied the aux by the world size on top).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..case import Case
from ..errors import InvalidArgument
from ..measure.collectives import attach_mesh_counter, uncounted
from .base import Pitfall, finish_step
from .ddp import Ddp, Distributed

EXPERTS_CONTRACT = ("a module holding experts (an nn.ModuleList) and mix(hidden, weights), the sum of "
                    "weights[..., e:e+1] * experts[e](hidden) over its experts (cases/experts.py's RoutedTokens)")


def expert_holders(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` that declare their experts (:data:`EXPERTS_CONTRACT`), by name."""
    return {name: module for name, module in model.named_modules()
            if isinstance(getattr(module, "experts", None), nn.ModuleList) and callable(getattr(module, "mix", None))}


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Distributed):
    name = "ep"
    summary = ("expert parallelism: W ranks, each E/W of the case's experts and its shard of the global batch, tokens "
               "sent to their experts' ranks and back by all_to_all_single; the dense gradients summed over the ranks")
    syncs_per_step = None  # no wrapper syncs: every collective is counted by kind (all_to_all[ep], all_reduce[ep])

    def wrap(self, model: nn.Module, objective) -> nn.Module:
        holders = expert_holders(model)
        if not holders:
            raise InvalidArgument(f"regime {str(self)!r} on case {objective.case.name!r}: the model declares no "
                                  f"experts: expected {EXPERTS_CONTRACT}")
        for name, holder in holders.items():
            if len(holder.experts) % self.world_size:
                raise InvalidArgument(f"regime {str(self)!r}: {name or 'the model'} holds {len(holder.experts)} "
                                      f"experts: expected a multiple of world_size={self.world_size}, E/W on each rank")
            holder.mix = functools.partial(dispatched_mix, holder)
        object.__setattr__(self, "_owners", expert_owners(holders, self.world_size))  # this rank's run, as MeshStep's names
        return model

    def count_communication(self, module):
        return attach_mesh_counter(module, layout={"ep": self.world_size})

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        loss = objective.share(objective.forward(model, mine.inputs, mine.targets), mine.targets, batch)
        objective.backward(loss)
        sum_dense_gradients(model, self._owners, self.expert_gradient_scale())
        finish_step(optimizer, objective)
        return loss.detach()

    def expert_gradient_scale(self) -> float:
        """What this rank's experts' gradients are multiplied by before the step: 1 (they hold every rank's tokens)."""
        return 1.0

    def full_tensor(self, tensor: Tensor, name: str = "") -> Tensor:
        """An expert's weight or gradient from its rank (the others hold a copy nobody trains); the rest as held."""
        owner = next((rank for prefix, rank in getattr(self, "_owners", {}).items() if name.startswith(prefix)), None)
        if owner is None:
            return tensor
        whole = tensor.detach().clone()
        with uncounted():  # the harness's read-back: no collective of the step
            dist.broadcast(whole, src=owner)
        return whole


def expert_owners(holders: dict[str, nn.Module], world_size: int) -> dict[str, int]:
    """The rank holding each expert, by its parameters' name prefix (``moe.experts.3.``): E/W consecutive ones each."""
    return {f"{name}.experts.{e}." if name else f"experts.{e}.": e // (len(holder.experts) // world_size)
            for name, holder in holders.items() for e in range(len(holder.experts))}


def dispatched_mix(holder: nn.Module, hidden: Tensor, weights: Tensor) -> Tensor:
    """``holder.mix`` over ranks: each token, with its weights, to every rank holding an expert it chose, through
    those experts there, and back, summed (all_to_all_single both ways, differentiable)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    per = len(holder.experts) // world
    flat, gates = hidden.reshape(-1, hidden.shape[-1]), weights.reshape(-1, weights.shape[-1])
    picked = [(gates[:, r * per:(r + 1) * per] != 0).any(-1).nonzero().squeeze(-1) for r in range(world)]
    outgoing = torch.cat([torch.cat([flat[i], gates[i, r * per:(r + 1) * per]], -1) for r, i in enumerate(picked)])
    sending = torch.tensor([len(i) for i in picked], device=flat.device)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending)
    sending, receiving = sending.tolist(), receiving.tolist()
    group = dist.group.WORLD
    arrived = wait_tensor(all_to_all_single_autograd(outgoing, receiving, sending, group))
    tokens, local_gates = arrived[:, :flat.shape[1]], arrived[:, flat.shape[1]:]
    done = sum(local_gates[:, j : j + 1] * holder.experts[rank * per + j](tokens) for j in range(per))
    back = wait_tensor(all_to_all_single_autograd(done, sending, receiving, group))
    return flat.new_zeros(flat.shape).index_add(0, torch.cat(picked), back).reshape(hidden.shape)


def sum_dense_gradients(model: nn.Module, owners: dict[str, int], expert_scale: float = 1.0) -> None:
    """The dense parameters' gradients summed over the ranks, in one all-reduce; this rank's experts' multiplied by
    ``expert_scale`` (a pitfall's); an expert another rank holds gets a zero gradient here (its copy is never read:
    :meth:`ExpertParallel.full_tensor` reads the owner's)."""
    rank = dist.get_rank()
    dense = []
    for name, parameter in model.named_parameters():
        owner = next((r for prefix, r in owners.items() if name.startswith(prefix)), None)
        if owner is None:
            dense.append(parameter)
        elif owner != rank and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        elif owner == rank and parameter.grad is not None and expert_scale != 1.0:
            parameter.grad.mul_(expert_scale)
    grads = [p.grad for p in dense if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))



AUX_OVER_DP = "aux loss averaged over data-parallel ranks (aux / dp size)"
AUX_TIMES_WORLD = "aux loss scaled by the world size twice"
EXPERTS_AVERAGED = "expert gradients averaged over the expert-parallel group"


@dataclasses.dataclass(frozen=True)
class DdpAuxOverWorld(Ddp):
    name = "ddp_aux_over_world"
    summary = ("PITFALL: the main loss scaled by W for DDP's average, the case's aux terms not: every aux gradient "
               "1/W of the full batch's")
    pitfall = Pitfall(AUX_OVER_DP, twin="ddp")
    aux_scale_exponent = -1  # the aux terms' scale, as a power of the world size, beside the main loss's

    def validate(self, case: Case) -> None:
        super().validate(case)
        if not case.terms:
            raise InvalidArgument(f"regime {str(self)!r} on case {case.name!r}: the case's objective has no terms= "
                                  "beside its loss (ec.Term: a load-balancing loss, a z-loss) to normalise wrong")

    def rank_part(self, objective, batch):
        scale = float(self.world_size) ** self.aux_scale_exponent
        return lambda output, targets: objective.share(output, targets, batch, terms_scale=scale) * self.world_size


@dataclasses.dataclass(frozen=True)
class DdpAuxTimesWorld(DdpAuxOverWorld):
    name = "ddp_aux_times_world"
    summary = ("PITFALL: the case's aux terms scaled by W on top of the loss's scaling: every aux gradient W times "
               "the full batch's")
    pitfall = Pitfall(AUX_TIMES_WORLD, twin="ddp")
    aux_scale_exponent = 1


@dataclasses.dataclass(frozen=True)
class ExpertParallelAveraged(ExpertParallel):
    name = "ep_experts_averaged"
    summary = ("PITFALL: expert parallelism with the experts' gradients averaged over the ep ranks as the dense ones "
               "would be: every expert's gradient 1/W of the full batch's (DeepSpeed#5618)")
    pitfall = Pitfall(EXPERTS_AVERAGED, twin="ep")

    def expert_gradient_scale(self) -> float:
        return 1.0 / self.world_size
