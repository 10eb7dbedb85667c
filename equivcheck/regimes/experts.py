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
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from ..case import Case
from ..device import DEFAULT_DEVICE
from ..errors import InvalidArgument
from ..measure.collectives import attach_mesh_counter
from ..process.torch_imports import fsdp2, fsdp2_missing, is_dtensor
from .base import Pitfall, expect_max_norm, finish_step, scale_to, squared_norm
from .ddp import Ddp, Distributed, set_mesh_world_size, whole_from

EXPERTS_CONTRACT = ("a module holding experts (an nn.ModuleList) and mix(hidden, weights), the sum of "
                    "weights[..., e:e+1] * experts[e](hidden) over its experts (cases/experts.py's RoutedTokens)")


def expert_holders(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` that declare their experts (:data:`EXPERTS_CONTRACT`), by name."""
    return {name: module for name, module in model.named_modules()
            if isinstance(getattr(module, "experts", None), nn.ModuleList) and callable(getattr(module, "mix", None))}


@dataclasses.dataclass
class ExpertPlacement:
    """Where a run's experts live: the ep index of the rank holding each (by its parameters' name prefix,
    ``moe.experts.3.``: E/ep consecutive ones each), the ep group its tokens are exchanged in, and the group of its
    replicas (the ranks of one ep index over dp; None without dp)."""

    owners: dict[str, int]
    ep: object
    replicas: object | None = None

    def owner(self, name: str) -> int | None:
        return next((index for prefix, index in self.owners.items() if name.startswith(prefix)), None)


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Distributed):
    name = "ep"
    summary = ("expert parallelism: W ranks, each E/W of the case's experts and its shard of the global batch, tokens "
               "sent to their experts' ranks and back by all_to_all_single; the dense gradients summed over the ranks")
    syncs_per_step = None  # no wrapper syncs: every collective is counted by kind (all_to_all[ep], all_reduce[ep])
    fits_some_cases = True  # a model that declares its experts
    # clip the whole gradient to it before each step, each logical element counted once; after the mesh in a spec
    max_norm: float = dataclasses.field(default=math.inf, kw_only=True, metadata={"trailing": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_max_norm(self.max_norm)

    def clips_at(self) -> float | None:
        return self.max_norm if self.max_norm < math.inf else None

    @property
    def layout(self) -> dict[str, int]:
        """The mesh's dimensions by name, row-major: the ranks of one ep group consecutive."""
        return {"ep": self.world_size}

    @property
    def dense_average(self) -> int:
        """What a rank's share of the objective is multiplied by: 1, its dense gradients summed over the ranks here
        (FSDP2, which averages them, needs the world size)."""
        return 1

    def wrap(self, model: nn.Module, objective) -> nn.Module:
        holders = expert_holders(model)
        if not holders:
            raise InvalidArgument(f"regime {str(self)!r} on case {objective.case.name!r}: the model declares no "
                                  f"experts: expected {EXPERTS_CONTRACT}")
        ep = self.layout["ep"]
        for name, holder in holders.items():
            if len(holder.experts) % ep:
                raise InvalidArgument(f"regime {str(self)!r}: {name or 'the model'} holds {len(holder.experts)} "
                                      f"experts: expected a multiple of ep={ep}, E/ep on each rank")
        placement = self.placement_of(model, holders)
        for holder in holders.values():
            holder.mix = functools.partial(dispatched_mix, holder, placement.ep)
        object.__setattr__(self, "_experts", placement)  # this rank's run, as MeshStep keeps its names
        return self.wrap_dense(model, {p for holder in holders.values() for p in holder.experts.parameters()})

    def placement_of(self, model: nn.Module, holders: dict[str, nn.Module]) -> ExpertPlacement:
        return ExpertPlacement(expert_owners(holders, self.world_size), dist.group.WORLD)

    def wrap_dense(self, model: nn.Module, experts: set[nn.Parameter]) -> nn.Module:
        """The model with its dense parameters as this regime holds them: plain replicas here."""
        return model

    def count_communication(self, module):
        return attach_mesh_counter(module, layout=self.layout)

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        share = objective.share(objective.forward(model, mine.inputs, mine.targets), mine.targets, batch)
        objective.backward(share * self.dense_average)
        self.reduce_gradients(model)
        if self.max_norm < math.inf:
            scale_to(optimizer, self.max_norm, self.total_norm(model))
        finish_step(optimizer, objective)
        return share.detach()

    def total_norm(self, model: nn.Module) -> Tensor:
        """The whole gradient's norm, every logical element once: the dense gradients' (alike on every rank, or
        FSDP2's shards, each counted once), and each expert's from the rank holding it, summed over the ep group
        (its replicas over dp hold the same)."""
        ep_rank, dense, experts = dist.get_rank(self._experts.ep), [], []
        for name, parameter in model.named_parameters():
            owner = self._experts.owner(name)
            if parameter.grad is not None and owner in (None, ep_rank):
                (dense if owner is None else experts).append(parameter.grad)
        like = next(model.parameters())
        dense_norm = torch.nn.utils.get_total_norm(dense) if dense else torch.zeros((), dtype=like.dtype)
        dense_norm = dense_norm.full_tensor() if is_dtensor(dense_norm) else dense_norm
        return (dense_norm.to(like.dtype) ** 2 + self.expert_squares(squared_norm(experts, like))).sqrt()

    def expert_squares(self, mine: Tensor) -> Tensor:
        """This rank's experts' squared gradient norm summed over the ep group: every expert's once."""
        dist.all_reduce(mine, group=self._experts.ep)
        return mine

    def reduce_gradients(self, model: nn.Module) -> None:
        """The dense gradients summed over the ranks (one all-reduce), the experts' as :func:`reduce_experts` leaves
        them."""
        reduce_experts(model, self._experts, self.expert_gradient_scale())
        summed([p.grad for name, p in model.named_parameters()
                if self._experts.owner(name) is None and p.grad is not None], dist.group.WORLD)

    def expert_gradient_scale(self) -> float:
        """What this rank's experts' gradients are multiplied by before the step: 1 / the dense average (they hold
        every rank's tokens already)."""
        return 1.0 / self.dense_average

    def full_tensor(self, tensor: Tensor, name: str = "") -> Tensor:
        """An expert's weight or gradient from its rank in the ep group (the others hold a copy nobody trains); the
        rest as the dense parameters are held (whole, or gathered from FSDP2's shards)."""
        placement = getattr(self, "_experts", None)
        owner = placement.owner(name) if placement is not None else None
        if owner is None:
            return super().full_tensor(tensor, name)
        return whole_from(owner, placement.ep, tensor)


@dataclasses.dataclass(frozen=True)
class FsdpExpertParallel(ExpertParallel):
    name = "fsdp_ep"
    summary = ("a dp x ep mesh: the experts spread over ep (E/ep each) and replicated over dp, their gradients summed "
               "over the replicas; FSDP2 over the dense parameters on every rank; each rank its shard of the batch")
    world_size: int = dataclasses.field(default=0, metadata={"derived": "dp * ep"})
    dp: int = dataclasses.field(default=1, kw_only=True)
    ep: int = dataclasses.field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        set_mesh_world_size(self, ("dp", "ep"))
        super().__post_init__()

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dp, "ep": self.ep}

    @property
    def dense_average(self) -> int:
        return self.world_size

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        return fsdp2_missing() or super().unavailable(device)

    def placement_of(self, model, holders):
        mesh = init_device_mesh(next(model.parameters()).device.type, (self.dp, self.ep), mesh_dim_names=("dp", "ep"))
        return ExpertPlacement(expert_owners(holders, self.ep), mesh["ep"].get_group(),
                               mesh["dp"].get_group() if self.dp > 1 else None)

    def wrap_dense(self, model, experts):
        """FSDP2 over every rank on the dense parameters, the experts left out (each lives on its ep rank)."""
        mesh = init_device_mesh(next(model.parameters()).device.type, (self.world_size,))
        return fsdp2().fully_shard(model, mesh=mesh, ignored_params=experts)

    def reduce_gradients(self, model):
        """FSDP2 has averaged the dense gradients; the experts' are summed over their replicas here."""
        reduce_experts(model, self._experts, self.expert_gradient_scale())


def expert_owners(holders: dict[str, nn.Module], ep: int) -> dict[str, int]:
    """The ep index holding each expert, by its parameters' name prefix: E/ep consecutive experts each."""
    return {f"{name}.experts.{e}." if name else f"experts.{e}.": e // (len(holder.experts) // ep)
            for name, holder in holders.items() for e in range(len(holder.experts))}


def dispatched_mix(holder: nn.Module, group, hidden: Tensor, weights: Tensor) -> Tensor:
    """``holder.mix`` over the ranks of ``group``: each token, with its weights, to every rank holding an expert it
    chose, through those experts there, and back, summed (all_to_all_single both ways, differentiable)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = len(holder.experts) // world
    flat, gates = hidden.reshape(-1, hidden.shape[-1]), weights.reshape(-1, weights.shape[-1])
    picked = [(gates[:, r * per:(r + 1) * per] != 0).any(-1).nonzero().squeeze(-1) for r in range(world)]
    outgoing = torch.cat([torch.cat([flat[i], gates[i, r * per:(r + 1) * per]], -1) for r, i in enumerate(picked)])
    sending = torch.tensor([len(i) for i in picked], device=flat.device)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=group)
    sending, receiving = sending.tolist(), receiving.tolist()
    arrived = wait_tensor(all_to_all_single_autograd(outgoing, receiving, sending, group))
    tokens, local_gates = arrived[:, :flat.shape[1]], arrived[:, flat.shape[1]:]
    done = sum(local_gates[:, j : j + 1] * holder.experts[rank * per + j](tokens) for j in range(per))
    back = wait_tensor(all_to_all_single_autograd(done, sending, receiving, group))
    return flat.new_zeros(flat.shape).index_add(0, torch.cat(picked), back).reshape(hidden.shape)


def reduce_experts(model: nn.Module, placement: ExpertPlacement, scale: float) -> None:
    """This rank's experts' gradients summed over their replicas (where there are), times ``scale``; an expert another
    rank holds gets a zero gradient (its copy is never read: :meth:`ExpertParallel.full_tensor` reads the owner's)."""
    ep_rank = dist.get_rank(placement.ep)
    mine = []
    for name, parameter in model.named_parameters():
        owner = placement.owner(name)
        if owner is not None and owner != ep_rank and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        elif owner == ep_rank and parameter.grad is not None:
            mine.append(parameter.grad)
    if placement.replicas is not None:
        summed(mine, placement.replicas)
    if scale != 1.0:
        for grad in mine:
            grad.mul_(scale)


def summed(grads: list[Tensor], group) -> None:
    """``grads`` summed over ``group`` in place, in one all-reduce of them flattened."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, total in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(total.view_as(grad))


AUX_OVER_DP = "aux loss averaged over data-parallel ranks (aux / dp size)"
AUX_TIMES_WORLD = "aux loss scaled by the world size twice"
EXPERTS_AVERAGED = "expert gradients averaged over the expert-parallel group"
EXPERTS_OVER_DP = "expert gradients divided by their replicas only (ep times too large)"


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
        return 1.0 / self.world_size / self.dense_average


EXPERTS_CLIPPED_ON_THEIR_RANK = "clipping by a norm that counts the experts on their own rank only (EP)"


class ClipsWithLocalExperts:
    """The whole gradient clipped by a norm that counts only the experts this rank holds (ColossalAI#2192's, whose
    MoE parameters' norms stayed on their rank; NVIDIA-NeMo/Automodel#3816's plain-tensor experts never summed over
    the ep axis): each rank clips by its own norm, short of every other rank's experts."""

    def expert_squares(self, mine: Tensor) -> Tensor:
        return mine


@dataclasses.dataclass(frozen=True)
class ExpertParallelClipLocal(ClipsWithLocalExperts, ExpertParallel):
    name = "ep_clip_local_experts"
    summary = "PITFALL: clipping by a norm of the dense gradients and this rank's experts alone"
    pitfall = Pitfall(EXPERTS_CLIPPED_ON_THEIR_RANK, twin="ep")


@dataclasses.dataclass(frozen=True)
class FsdpExpertParallelClipLocal(ClipsWithLocalExperts, FsdpExpertParallel):
    name = "fsdp_ep_clip_local_experts"
    summary = ("PITFALL: dp x ep clipping by the dense shards' norm (FSDP2's DTensors, right) and this rank's experts "
               "alone")
    pitfall = Pitfall(EXPERTS_CLIPPED_ON_THEIR_RANK, twin="fsdp_ep")


@dataclasses.dataclass(frozen=True)
class FsdpExpertParallelOverReplicas(FsdpExpertParallel):
    name = "fsdp_ep_experts_over_dp"
    summary = ("PITFALL: dp x ep with each expert's gradient averaged over its dp replicas, while the loss was scaled "
               "by dp * ep for FSDP2's average: every expert's gradient ep times too large (pytorch#160285)")
    pitfall = Pitfall(EXPERTS_OVER_DP, twin="fsdp_ep")

    def expert_gradient_scale(self) -> float:
        return 1.0 / self.dp
