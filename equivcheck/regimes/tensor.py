"""Tensor parallelism: the case's plan applied with ``parallelize_module`` over W ranks (a mesh of one dimension),
every rank seeing the whole global batch.

A colwise Linear holds a slice of its output features on each rank, a rowwise Linear a slice of its input features
(its partial outputs all-reduced in its forward). Every rank computes the same loss on the same batch, so each
sharded gradient is its shard of the full one, and a replicated parameter (a rowwise bias) gets the full gradient on
every rank with no collective of its own. The harness reads gradients and weights back whole (``full_tensor``), and a
replicated parameter that drifts between ranks is the rank drift every distributed regime reports.

The plan is the case's ``tp_plan`` (module names, ``fnmatch`` patterns allowed, to ``"colwise"``,
``"colwise_local"``, ``"rowwise"``, ``"sequence"``), or one derived for the common shapes: Linear, parameter-free
modules, Linear (colwise, then rowwise); attention projections (queries, keys and values by heads, each rank's kept
local, the output rowwise). A case with neither cannot take these regimes, which a matrix then skips there, saying
so. ``fsdp_tp`` adds FSDP2 over ``dp`` on a ``dp x tp`` mesh (:class:`DpTpMesh`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
import warnings
from collections.abc import Iterator
from typing import ClassVar

import torch

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..case import Case
from ..device import DEFAULT_DEVICE
from .fsdp import shard_blocks
from .ddp import set_mesh_world_size, shard
from ..errors import InvalidArgument
from ..process.torch_imports import fsdp2_missing
from ..process.seeding import DEFAULT_SEED, seed_torch, seeded
from ..process.torch_imports import is_dtensor
from .base import DeclaresCollectives, Pitfall, Regime, expect_max_norm, finish_step, parameters_of
from .ddp import Distributed


# An attention module's projections, by the names its family gives them (Llama and Hugging Face; torchtitan; BERT):
# queries, keys and values sharded by heads (colwise, the rank's heads kept local), the output projection rowwise.
ATTENTION_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo"),
                         ("query", "key", "value", "out"))
# The attributes an attention module counts its heads by: divided by the TP size, as torchtitan's plan does.
HEAD_COUNTS = ("n_heads", "n_head", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")


def derived_plan(model: nn.Module) -> dict[str, str]:
    """Linear, parameter-free modules (an activation, dropout), Linear, in one ``nn.Sequential``: the first colwise,
    the second rowwise, as Megatron shards an MLP; every such pair of every Sequential in the model. And attention
    projections named as :data:`ATTENTION_PROJECTIONS` names them: heads local per rank. Empty where the model has
    none."""
    plan: dict[str, str] = {}
    for prefix, module in model.named_modules():
        children = dict(module.named_children())
        for names in ATTENTION_PROJECTIONS:
            if all(isinstance(children.get(name), nn.Linear) for name in names):
                *inputs, output = (f"{prefix}.{name}" if prefix else name for name in names)
                plan |= dict.fromkeys(inputs, "colwise_local") | {output: "rowwise"}
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        first = None
        for name, child in children:
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                if first is not None and full not in plan:
                    plan[first], plan[full] = "colwise", "rowwise"
                    first = None
                else:
                    first = full
            elif any(True for _ in child.parameters()):
                first = None
    return plan


def plan_for(case: Case, model: nn.Module, world_size: int) -> dict[str, str]:
    """The plan to apply to ``model``, each name resolved to a module; InvalidArgument naming what does not fit."""
    given = case.tp_plan
    plan = dict(given) if given is not None else derived_plan(model)
    if not plan:
        raise InvalidArgument(
            f"case {case.name!r} has no tensor-parallel plan: its model has no Linear, activation, Linear in an "
            "nn.Sequential to derive one from; expected tp_plan= on the case (module names to 'colwise', 'rowwise' "
            "or 'sequence')")
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            raise InvalidArgument(f"tp_plan of case {case.name!r}: {pattern!r} names no module of its model; its "
                                  f"modules: {', '.join(name for name in modules if name)}")
        for name in names:
            resolved[name] = style
            _expect_divisible(case, name, modules[name], style, world_size)
    for owner in _head_owners(model, resolved):
        for attribute, heads in _head_counts(owner):
            if heads % world_size:
                raise InvalidArgument(f"tp_plan of case {case.name!r}: an attention module has {attribute}={heads}, "
                                      f"which do not divide over world_size={world_size}")
    return resolved


def _head_owners(model: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """The modules whose heads a plan keeps local per rank: the parents of its ``colwise_local`` Linears."""
    owners = {name.rpartition(".")[0] for name, style in plan.items() if style == "colwise_local"}
    return [model.get_submodule(name) for name in sorted(owners)]


def _head_counts(module: nn.Module) -> list[tuple[str, int]]:
    return [(name, value) for name in HEAD_COUNTS
            if isinstance(value := getattr(module, name, None), int) and not isinstance(value, bool)]


def localize_heads(model: nn.Module, plan: dict[str, str], tp_size: int) -> None:
    """Each attention module of the plan counts the heads its rank holds, as torchtitan's plan sets them: its
    projections' local outputs are that many heads wide."""
    for owner in _head_owners(model, plan):
        for attribute, heads in _head_counts(owner):
            setattr(owner, attribute, heads // tp_size)


def applied_plan(model: nn.Module, mesh, plan: dict[str, str], tp_size: int) -> nn.Module:
    """``model`` with ``plan`` applied over ``mesh`` (``parallelize_module``), its attention heads local per rank."""
    from torch.distributed.tensor.parallel import parallelize_module

    localize_heads(model, plan, tp_size)
    with frozen_kept(model):
        return parallelize_module(model, mesh, {name: parallel_style(style) for name, style in plan.items()})


@contextlib.contextmanager
def frozen_kept(model: nn.Module) -> Iterator[None]:
    """The parameters frozen before a plan is applied frozen after it: torch's ``SequenceParallel`` registers every
    parameter it replicates as trainable (measured, torch 2.13), which would train a frozen norm of an adapted model."""
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    yield
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def _expect_divisible(case: Case, name: str, module: nn.Module, style: str, world_size: int) -> None:
    """A Linear sharded over W ranks needs its sharded dimension divisible by W: torch would shard it unevenly."""
    if not isinstance(module, nn.Linear) or style == "sequence":
        return
    features = module.out_features if style.startswith("colwise") else module.in_features
    if features % world_size:
        side = "output" if style.startswith("colwise") else "input"
        raise InvalidArgument(f"tp_plan of case {case.name!r}: {name} ({style}) has {features} {side} features, "
                              f"which do not divide over world_size={world_size}")


def parallel_style(style: str):
    """torch's ParallelStyle for a plan's style name."""
    from torch.distributed.tensor import parallel

    if style == "colwise":  # its output stays a DTensor: dropout on it can be placed in the global batch's masks
        return parallel.ColwiseParallel(use_local_output=False)
    return {"colwise_local": parallel.ColwiseParallel, "rowwise": parallel.RowwiseParallel,
            "sequence": parallel.SequenceParallel}[style]()


@dataclasses.dataclass(frozen=True)
class TensorParallel(DeclaresCollectives, Distributed):
    name = "tp"
    summary = ("tensor parallelism: the case's plan (parallelize_module) over W ranks, each seeing the whole batch; "
               "max_norm=M clips the whole gradient; collectives=all_reduce[tp]*1 declares a step's communication")
    syncs_per_step = None  # TP synchronises activations in the forward and backward, never gradients
    fits_some_cases = True  # a tensor-parallel plan: the case's tp_plan, or one derived from its model's shape
    shards_sequence: ClassVar[bool] = False  # runs a plan's 'sequence' modules on sequence shards (tp_sp)
    max_norm: float = math.inf

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_max_norm(self.max_norm)

    def clips_at(self) -> float | None:
        return self.max_norm if self.max_norm < math.inf else None

    def validate(self, case: Case) -> None:
        """The plan too, read off the case's model built once (seeded, so no random state moves): a case with no
        plan, or one that does not divide over the ranks, cannot take this regime, which a matrix skips there. Every
        rank sees the whole batch: unlike a data-parallel regime, more ranks than samples is no misfit."""
        Regime.validate(self, case)
        try:
            with seeded(DEFAULT_SEED):
                model = case.model()
        except Exception:  # a model that cannot be built here: training tells
            return
        plan = plan_for(case, model, self.tp_size)
        if "sequence" in plan.values() and not self.shards_sequence:
            raise InvalidArgument(
                f"case {case.name!r} has sequence-parallel modules in its tensor-parallel plan, which regime "
                f"{str(self)!r} does not shard: expected tp_sp or fsdp_tp_sp for it (or a plan without 'sequence')")

    def count_communication(self, module: nn.Module):
        """Every collective of a step by kind and mesh dimension (``"all_reduce[tp]"``); no gradient sync: DTensor's
        collectives carry the plan's activations, FSDP2's (``fsdp_tp``) its dp shards."""
        from ..measure.collectives import attach_mesh_counter

        return attach_mesh_counter(module, ("tp",))

    def wrap(self, model: nn.Module, objective) -> nn.Module:
        plan = plan_for(objective.case, model, self.tp_size)
        return self.over_tp(model, plan, init_device_mesh(next(model.parameters()).device.type,
                                                          (dist.get_world_size(),)))

    def over_tp(self, model: nn.Module, plan: dict[str, str], mesh) -> nn.Module:
        """``plan`` applied over ``mesh``, the TP group's (one dimension)."""
        return applied_plan(model, mesh, plan, self.tp_size)

    @property
    def tp_size(self) -> int:
        """The ranks one tensor-parallel group spans: all of them, on a mesh of one dimension."""
        return self.world_size

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_batch(batch)
        with plan_refusals():
            loss = self.rank_part(objective, batch)(objective.forward(model, mine.inputs, mine.targets), mine.targets)
            objective.backward(loss)
        self.finalize_grads(model)
        self.clip(optimizer, objective)
        finish_step(optimizer, objective)
        return loss.detach() / self.world_size  # each rank's share: dispatch adds them up to the loss

    def finalize_grads(self, model: nn.Module) -> None:
        """After the backward, before clipping and the step (Megatron's ``finalize_model_grads``): nothing to do under
        torch's styles. A replicated parameter's gradient (a norm's, a head's) is a DTensor, ``Partial(sum)`` after the
        backward under sequence parallelism (measured, torch 2.13): DTensor sums it over the ranks where it is read
        (the step, clipping, ``full_tensor``)."""

    def clip(self, optimizer, objective) -> None:
        """``clip_grad_norm_`` over the DTensor gradients: the norm of the whole gradient, every shard counted once."""
        if self.max_norm < math.inf:
            objective.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters_of(optimizer), self.max_norm)

    def rank_batch(self, batch):
        """Every rank of a TP group sees the whole global batch."""
        return batch

    def rank_part(self, objective, batch):
        """The loss a rank back-propagates: its batch's share of the global batch's objective times
        :attr:`loss_scale`."""
        return lambda output, targets: objective.share(output, targets, batch) * self.loss_scale

    @property
    def loss_scale(self) -> float:
        """Every rank of a TP group back-propagates the global batch's loss, unscaled: no rank is a data-parallel one."""
        return 1


@dataclasses.dataclass(frozen=True)
class TensorParallelDifferentBatches(TensorParallel):
    name = "tp_different_batches"
    summary = "PITFALL: TP ranks fed different batches (each its data-parallel shard), as if TP were DP"
    pitfall = Pitfall("tensor-parallel ranks fed different batches", twin="tp")

    def rank_batch(self, batch):
        return self.rank_shard(batch)

    @property
    def loss_scale(self) -> float:
        return self.world_size  # each shard's loss scaled as DDP would: right for data parallelism, not here


@dataclasses.dataclass(frozen=True)
class TensorParallelLossScaled(TensorParallel):
    name = "tp_loss_scaled"
    summary = "PITFALL: the loss divided by the TP size, as if each TP rank were a data-parallel one"
    pitfall = Pitfall("loss scaled by the tensor-parallel size", twin="tp")

    @property
    def loss_scale(self) -> float:
        return 1 / self.world_size


@dataclasses.dataclass(frozen=True)
class TensorParallelClipLocal(TensorParallel):
    name = "tp_clip_local"
    summary = "PITFALL: clipping by the norm of this rank's local shards, not the whole gradient's"
    # Its max_norm is the bug's: the twin is plain TP, whose clipping is the case's own (clip_grad_norm_ over DTensors).
    pitfall = Pitfall("clipping by the norm of local shards under tensor parallelism", twin="tp:max_norm=inf")

    def clip(self, optimizer, objective) -> None:
        if self.max_norm == math.inf:
            return
        objective.scaler.unscale_(optimizer)
        local = [(p.grad.to_local() if is_dtensor(p.grad) else p.grad) for p in parameters_of(optimizer)
                 if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
        scale = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        for grad in local:  # each rank scales its own shard (and its replicas) by its own norm
            grad.mul_(scale)


@dataclasses.dataclass(frozen=True)
class TensorParallelDropoutRankSeeded(TensorParallel):
    name = "tp_dropout_rank_seeded"
    summary = ("PITFALL: every rank seeds its dropout with seed + rank, as data-parallel code does: the ranks of a TP "
               "group draw other masks for the activations they hold alike")
    pitfall = Pitfall("dropout seeded per rank inside a tensor-parallel group", twin="tp")

    def random_streams(self, model, optimizer, inputs):
        return _seeded_by_rank()


@contextlib.contextmanager
def _seeded_by_rank() -> Iterator[None]:
    """The generator seeded with seed + rank, and each rank drawing its own masks: right across data-parallel ranks,
    wrong inside a TP group, whose ranks must draw alike where they hold the same activation."""
    seed_torch(torch.initial_seed() + dist.get_rank())
    with warnings.catch_warnings():  # torch's own word on DTensor's dropout of a CPU mesh, which is the bug's draws
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        yield


# torch's refusals of an op on DTensors that a plan which keeps some activation a DTensor meets (on the CPU: attention).
DTENSOR_REFUSALS = ("does not have a sharding strategy registered", "got mixed torch.Tensor and DTensor")


@contextlib.contextmanager
def plan_refusals() -> Iterator[None]:
    """torch's refusal of an op a plan hands DTensors to, with the way out in a plan's words."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as error:
        if not any(words in str(error) for words in DTENSOR_REFUSALS):
            raise
        raise type(error)(f"{error} (the tensor-parallel plan hands this op DTensors, which it cannot take here: keep "
                          "the activation a local tensor, 'colwise_local' for attention's query, key and value "
                          "projections, its heads local per rank)") from error


def quiet_read_back() -> None:
    """On a rank of a 2-D mesh, reading a parameter back whole (``full_tensor``) gathers over both dimensions in turn,
    and torch warns that this is slower: the harness's own doing, exact (a gather adds nothing), once per tensor."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _quiet_mesh_warnings() -> None:
    """On ``fsdp_tp``'s mesh, besides the read-back, FSDP2 notes that a TP-sharded Linear of the regime's own plan
    returns a view (an in-place op on it would be the model's own bug, which the comparison would show)."""
    quiet_read_back()
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)


@dataclasses.dataclass(frozen=True)
class DpTpMesh:
    """A regime on a ``dp x tp`` mesh (torchtitan's 2-D layout, row-major: the ranks of one TP group are consecutive),
    D x T ranks: each TP group sees its data-parallel rank's shard of the global batch, identical on every rank of the
    group, and FSDP2 over ``dp`` averages the groups' gradients as DDP does."""

    world_size: int = dataclasses.field(default=0, metadata={"derived": "dp * tp"})
    dp: int = dataclasses.field(kw_only=True)
    tp: int = dataclasses.field(kw_only=True)

    def __post_init__(self) -> None:
        set_mesh_world_size(self, ("dp", "tp"))
        super().__post_init__()

    @property
    def tp_size(self) -> int:
        return self.tp

    def validate(self, case: Case) -> None:
        super().validate(case)
        if self.dp > case.batch_size:
            raise InvalidArgument(f"regime {str(self)!r} on case {case.name!r}: dp={self.dp} is not allowed: expected "
                                  f"an integer from 1 to {case.batch_size} (the case's batch_size: every group needs "
                                  "a sample)")

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        return fsdp2_missing() or super().unavailable(device)

    def wrap(self, model: nn.Module, objective) -> nn.Module:
        """The regime's plan over ``tp`` (``over_tp``), then FSDP2 over ``dp`` on every block and the root."""
        plan = plan_for(objective.case, model, self.tp)
        _quiet_mesh_warnings()
        mesh = init_device_mesh(next(model.parameters()).device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return shard_blocks(self.over_tp(model, plan, mesh["tp"]), mesh["dp"], reshard_after_forward=True)

    def rank_batch(self, batch):
        """This rank's data-parallel shard: the mesh is row-major, so the ranks of one TP group are consecutive."""
        return shard(batch, dist.get_rank() // self.tp, self.dp)

    @property
    def loss_scale(self) -> float:
        """FSDP2 averages the dp groups' gradients, as DDP averages ranks: each shard's loss sum times dp."""
        return self.dp


@dataclasses.dataclass(frozen=True)
class FsdpTensorParallel(DpTpMesh, TensorParallel):
    """FSDP2 over ``dp`` and tensor parallelism over ``tp`` on a ``dp x tp`` mesh."""

    name = "fsdp_tp"
    summary = "FSDP2 over dp and the case's TP plan over tp: a dp x tp mesh, each TP group its dp shard of the batch"


@dataclasses.dataclass(frozen=True)
class FsdpTensorParallelWorldScaled(FsdpTensorParallel):
    name = "fsdp_tp_world_scaled"
    summary = "PITFALL: on a dp x tp mesh, the loss scaled by every rank (dp * tp), each TP rank counted as a DP one"
    pitfall = Pitfall("loss scaled by the tensor-parallel size", twin="fsdp_tp")

    @property
    def loss_scale(self) -> float:
        return self.world_size
