"""A team's own training code as a regime, so CI can gate it against a reference.

``UserStep`` runs ``step(model, optimizer, (inputs, targets))`` once per global batch; ``UserLoop``
runs ``loop(model, optimizer, batches)`` over all of them (schedulers and other state that lives
across steps belong there). ``DdpStep`` runs the step on every rank of a process group: the harness
wraps the model in DistributedDataParallel (or calls the team's own ``wrapper(model)``, which may wrap
parts of it apart, as seed 000's trunk and head) and hands each rank its contiguous shard of the
global batch, as a DistributedSampler would. The team may shard the optimizer as they do, too: their
``optimizer_wrapper(optimizer)`` (ZeroRedundancyOptimizer around the case's optimizer, say) makes what the
step is handed. ``PipelineStep`` (and ``PipelineLoop``) runs a step that drives its own pipeline schedule
on every rank instead: the whole model, unwrapped, and the whole global batch, every stage's gradients
broadcast to every rank before the optimizer steps. Only plain data crosses to the worker ranks, so the
step and the wrappers travel as import paths of module-level functions (``module:function``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import TensorDataset

from ..case import Batch, Objective
from ..errors import InvalidArgument, expect_callable, expect_int
from ..process.import_paths import resolve
from ..measure.collectives import SUB_GROUP_PREFIX, StepTraffic, attach_mesh_counter, uncounted
from .base import DeclaresCollectives, Regime
from .ddp import DdpOptions, Distributed, shard
from ..process.torch_imports import is_dtensor
from .tensor import quiet_read_back
from .pipeline import share_team_gradients
from .zero import local_part, with_step_hooks_of


StepFn = Callable[[nn.Module, Optimizer, tuple[Tensor, Tensor]], object]
LoopFn = Callable[[nn.Module, Optimizer, list[tuple[Tensor, Tensor]]], "Iterable[object] | None"]


def _label(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@dataclasses.dataclass(frozen=True)
class UserCode(Regime):
    """A regime whose work is done by the team's function ``fn``; named after it (``step:my_step``)."""

    harness_scaler = False  # a team's own code steps its own scaler, if any
    fn: Callable

    def __post_init__(self) -> None:
        expect_callable(self.name, self.fn)

    def __str__(self) -> str:
        return f"{self.name}:{_label(self.fn)}"


@dataclasses.dataclass(frozen=True)
class UserStep(UserCode):
    """One optimizer step on one global batch, computed by the team's own ``fn``; with ``per_run``,
    ``fn()`` makes that step afresh for every run, so state it keeps across steps (a GradScaler, a
    schedule) starts anew where the reference starts."""

    per_run: bool = False
    counts_per_call = True
    name = "step"
    summary = "a team's own step function: one optimizer step on one global batch"

    def train(self, model, optimizer, batches: Sequence[Batch], objective: Objective):
        step = fresh_step(self.fn, self.per_run)
        return [step(model, optimizer, (b.inputs, b.targets)) for b in batches]


def fresh_step(fn: Callable, per_run: bool) -> Callable:
    """The step a run uses: ``fn`` itself, or what the factory ``fn`` makes for this run."""
    if not per_run:
        return fn
    step = fn()
    expect_callable("the step made by per_run's factory", step)
    return step


@dataclasses.dataclass(frozen=True)
class UserLoop(UserCode):
    """The team's own loop over every global batch; it returns one loss per batch, or None."""

    name = "loop"
    summary = "a team's own training loop over the global batches"
    steps_observable = False

    def train(self, model, optimizer, batches: Sequence[Batch], objective: Objective):
        losses = self.fn(model, optimizer, LoopBatches(batches, objective.epochs))
        return loop_losses(_label(self.fn), losses, batches)


def loop_losses(label: str, losses: Iterable[object] | None, batches: Sequence[Batch]) -> list[object]:
    """A loop's losses, one per global batch it trains (None: not reported); another count is the loop's mistake.
    A resumed loop (handed every batch, the first ``trained_from`` trained before its restart) reports what it trained
    again, however many: a loop that trains the first batches again is the resume's bug, which the comparison names."""
    trained_from = getattr(batches, "trained_from", 0)
    if losses is None:
        return [None] * (len(batches) - trained_from)
    losses = list(losses)
    if trained_from:
        return losses
    if len(losses) != len(batches):
        raise InvalidArgument(f"loop {label!r} returned {len(losses)} losses for {len(batches)} global batches: "
                              "expected one loss per batch, or None")
    return losses


class LoopBatches(list):
    """What a team's loop receives: every global batch as ``(inputs, targets)``, each epoch's in turn, the
    last of an epoch smaller where the case keeps a smaller last batch. A loop that builds its own
    DataLoader finds one epoch's samples, in the case's order, as ``.dataset`` (a TensorDataset), with
    ``.batch_size`` (samples per global batch) and ``.epochs``: ``DataLoader(batches.dataset,
    batch_size=batches.batch_size // K)`` (no shuffle, ``drop_last=False``) over ``range(batches.epochs)``
    yields micro-batches whose windows of K are exactly the global batches the reference steps on.

    On DDP ranks the batches are this rank's shards and ``.dataset`` holds them; ``.whole_dataset`` holds one epoch
    of every rank's samples (in one process, ``.dataset`` itself), for a loop whose own sampler decides what each
    rank trains on: ``DistributedSampler(batches.whole_dataset, ...)`` with ``batch_size=batches.batch_size``."""

    def __init__(self, batches: Sequence[Batch], epochs: int, whole_dataset: TensorDataset | None = None) -> None:
        super().__init__((b.inputs, b.targets) for b in batches)
        self.epochs = epochs
        self.batch_size = len(batches[0])
        self.dataset = epoch_dataset(batches, epochs)
        self.whole_dataset = self.dataset if whole_dataset is None else whole_dataset


def epoch_dataset(batches: Sequence[Batch], epochs: int) -> TensorDataset:
    """One epoch's samples of ``batches`` (every epoch's, in turn), in order, as one dataset."""
    one_epoch = list(batches)[: len(batches) // epochs]
    return TensorDataset(torch.cat([b.inputs for b in one_epoch]), torch.cat([b.targets for b in one_epoch]))


def expect_import_paths(regime: Regime, *arguments: str) -> None:
    """Each of ``regime``'s fields named is ``module:function`` (``fn`` always, the others where given)."""
    for argument in arguments:
        module, colon, function = getattr(regime, argument).partition(":")
        if not (module and colon and function) and (argument == "fn" or getattr(regime, argument)):
            raise InvalidArgument.value(argument, getattr(regime, argument),
                                        f"'module:function', the import path of a {argument} function")


@dataclasses.dataclass(frozen=True)
class DdpStep(DdpOptions, Distributed):
    counts_per_call = True
    harness_scaler = False
    name = "ddp_step"
    summary = "a team's own step function on every DDP rank, each given its shard of the global batch"
    fn: str = dataclasses.field(kw_only=True)  # module:function of the step
    wrapper: str = dataclasses.field(default="", kw_only=True)  # module:function of the team's wrap; "": DDP
    per_run: bool = dataclasses.field(default=False, kw_only=True)  # fn is a factory of the step, called per run
    # module:function making the optimizer the step is handed from the case's (ZeRO, say); "": the case's own
    optimizer_wrapper: str = dataclasses.field(default="", kw_only=True)
    # gradient syncs a faithful step of the team's makes per wrapped module: more than one where it means to (ZeRO-2
    # reducing every micro-batch); any other count is reported as a communication problem
    syncs: int = dataclasses.field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_import_paths(self, "fn", "wrapper", "optimizer_wrapper")
        expect_int("syncs", self.syncs)

    @property
    def syncs_per_step(self) -> int:
        return self.syncs

    def wrap(self, model, objective):
        return resolve(self.wrapper)(model) if self.wrapper else super().wrap(model, objective)

    def build_optimizer(self, case, model):
        optimizer = super().build_optimizer(case, model)
        if not self.optimizer_wrapper:
            return optimizer
        made = resolve(self.optimizer_wrapper)(optimizer)
        if not isinstance(made, Optimizer):
            raise InvalidArgument(f"optimizer_wrap {self.optimizer_wrapper!r} returned a {type(made).__name__}: expected a "
                                  "torch.optim.Optimizer (ZeroRedundancyOptimizer around the one it was given, say)")
        return with_step_hooks_of(optimizer, made)

    def local_optimizer(self, optimizer):
        return local_part(optimizer)

    def train(self, model, optimizer, batches, objective):
        step = fresh_step(resolve(self.fn), self.per_run)
        return [self.share(step(model, optimizer, (mine.inputs, mine.targets)))
                for mine in (self.team_shard(batch) for batch in batches)]

    @property
    def shards(self) -> tuple[str, int]:
        """What a global batch is cut over, by its argument's name: the ranks (``world_size``)."""
        return "world_size", self.world_size

    def team_shard(self, batch: Batch) -> Batch:
        """This rank's shard of ``batch``; a shard a team's code would get empty is refused, on every rank alike."""
        name, count = self.shards
        if len(batch) < count:  # every rank sees the global batch: they all raise, before any collective
            raise InvalidArgument(
                f"regime {str(self)!r}: a global batch of {len(batch)} sample(s) (an epoch's smaller last batch) is "
                f"not allowed over {name}={count}: some rank's shard would be empty, and a team's step is never "
                "handed an empty batch (a DistributedSampler pads the shard by repeating samples instead: see "
                f"ec.check_eval). Expected a last batch of at least {count} samples")
        return self.rank_shard(batch)

    def share(self, loss: object) -> Tensor | None:
        """This rank's share of what the ranks' code returned, averaged (dispatch adds the shares up): the
        global mean where shards hold equal item counts."""
        return None if loss is None else torch.as_tensor(float(loss), dtype=torch.float64) / self.world_size


@dataclasses.dataclass(frozen=True)
class DdpLoop(DdpStep):
    """The team's own loop on every rank: each global batch reaches it as this rank's shard."""

    name = "ddp_loop"
    summary = "a team's own training loop on every DDP rank, each given its shard of every global batch"
    steps_observable = False

    def train(self, model, optimizer, batches, objective):
        shards = LoopBatches([self.team_shard(b) for b in batches], objective.epochs,
                             whole_dataset=epoch_dataset(batches, objective.epochs))
        losses = resolve(self.fn)(model, optimizer, shards)
        return [self.share(loss) for loss in loop_losses(self.fn, losses, batches)]


@dataclasses.dataclass(frozen=True)
class PipelineStep(Distributed):
    """A team's own step running its own pipeline schedule (``torch.distributed.pipelining``) on every rank.

    Each rank is handed the whole model, not wrapped (a pipeline needs no DDP), the case's optimizer over all of
    it and the whole global batch (the first stage takes it; the schedule cuts it into micro-batches); the step
    builds its stage from its rank. A pipeline leaves each stage's gradients on its own rank, so when the step
    calls ``optimizer.step()`` a pre-hook the harness installs first broadcasts every gradient from the rank
    that holds it (:func:`equivcheck.regimes.pipeline.share_team_gradients`, uncounted, as the ``pipeline``
    regime does): every rank steps and reports the whole model, and the ranks' spread is checked as under DDP.
    The loss: only the last stage has one; the ranks' returned losses are added (None counting as nothing)."""

    counts_per_call = True
    harness_scaler = False
    name = "pipeline_step"
    summary = "a team's own step running its own pipeline schedule on every rank, each given the whole global batch"
    # A stage runs part of the model on its own rank's generator, as the pipeline regime does: no global masks.
    random_streams = Regime.random_streams
    fn: str = dataclasses.field(kw_only=True)  # module:function of the step
    per_run: bool = dataclasses.field(default=False, kw_only=True)  # fn is a factory of the step, called per run

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_import_paths(self, "fn")

    def wrap(self, model, objective):
        return model

    def build_optimizer(self, case, model):
        optimizer = super().build_optimizer(case, model)
        parameters = [p for p in model.parameters() if p.requires_grad]
        # Registered before GradRecorder's own pre-hook, so it runs first: the recorder snapshots the whole gradient.
        optimizer.register_step_pre_hook(lambda *_: share_team_gradients(parameters))
        return optimizer

    def count_communication(self, module):
        """The schedule's sends and receives, by kind (no gradient sync: stages exchange activations)."""
        return StepTraffic(None)

    def train(self, model, optimizer, batches, objective):
        step = fresh_step(resolve(self.fn), self.per_run)
        return stage_losses([step(model, optimizer, (batch.inputs, batch.targets)) for batch in batches])


@dataclasses.dataclass(frozen=True)
class PipelineLoop(PipelineStep):
    """The team's own loop running its own pipeline schedule on every rank, each given every whole global batch."""

    name = "pipeline_loop"
    summary = "a team's own training loop running its own pipeline schedule on every rank, given the whole batches"
    steps_observable = False

    def train(self, model, optimizer, batches, objective):
        losses = resolve(self.fn)(model, optimizer, LoopBatches(batches, objective.epochs))
        return stage_losses(loop_losses(self.fn, losses, batches))


# The named dimensions a team's mesh may have, in the order the mesh lays them out (torchtitan's): pipeline, data
# parallel, expert, context and tensor parallel. A mesh has pp, ep and cp only where they are asked for (above 1).
MESH_DIMENSIONS = ("pp", "dp", "ep", "cp", "tp")  # the layout's order: row-major, the ranks of one TP group consecutive
OPTIONAL_DIMENSIONS = ("pp", "ep", "cp")
DATA_DIMENSIONS = ("dp", "ep")  # each rank of these holds a shard of its own (an expert-parallel rank routes its tokens)


@dataclasses.dataclass(frozen=True)
class MeshStep(DeclaresCollectives, Distributed):
    """A team's own step on a mesh of named dimensions ([``pp`` x] ``dp`` [x ``ep``] [x ``cp``] x ``tp``; row-major: the
    ranks of one TP group are consecutive): the team's ``parallelizer(model, mesh)`` applies its own plan
    (``parallelize_module``, ``fully_shard``, its own Megatron-style layers, a context-parallel split, experts spread
    over ``ep`` with tokens exchanged by ``all_to_all``, its pipeline stages over ``pp``) and returns the model, over
    whose parameters the case's optimizer is made; the global batch is cut over the data dimensions (``dp`` x ``ep``:
    an expert-parallel rank routes tokens of its own), and every rank of one such group (its pp x cp x tp ranks) is
    handed that group's shard, the same on each. Weights and gradients are read back
    whole through DTensor's ``full_tensor()``, or the team's ``gatherer(name, local)`` for its own plain shards (on a
    pipeline, every tensor: a stage's DTensors are whole on its own ranks only); any other plain tensor is taken as
    replicated, and one that ends different on two ranks is a ``ranks disagree`` finding. A ``parallelize`` that returns
    ``(model, names)`` says which of the case's parameters each of this rank's is (experts numbered locally, from 0 on
    every rank): tensors are read back under those names, and one that only some ranks hold is broadcast from the first
    of them. On a pipeline only the last stage's ranks have a loss: the step's is their mean."""

    counts_per_call = True
    harness_scaler = False
    name = "mesh_step"
    summary = ("a team's own step on a [pp x] dp x [ep x] [cp x] tp mesh, its own parallelize(model, mesh) applied "
               "first; each data-parallel (dp x ep) group its shard")
    world_size: int = dataclasses.field(default=0, metadata={"derived": "pp * dp * ep * cp * tp"})
    fn: str = dataclasses.field(kw_only=True)  # module:function of the step
    parallelizer: str = dataclasses.field(kw_only=True)  # module:function of the team's parallelize(model, mesh)
    dp: int = dataclasses.field(default=1, kw_only=True)
    tp: int = dataclasses.field(default=1, kw_only=True)
    cp: int = dataclasses.field(default=1, kw_only=True)
    ep: int = dataclasses.field(default=1, kw_only=True)
    pp: int = dataclasses.field(default=1, kw_only=True)
    # module:function of the team's gather(name, local) -> the whole tensor, for weights it keeps as plain local shards
    gatherer: str = dataclasses.field(default="", kw_only=True)
    per_run: bool = dataclasses.field(default=False, kw_only=True)  # fn is a factory of the step, called per run
    syncs_per_step = None  # a team's plan synchronises in its own way: its collectives are counted, by kind and dimension

    def __post_init__(self) -> None:
        for name in MESH_DIMENSIONS:
            expect_int(name, getattr(self, name))
        ranks = math.prod(self.sizes.values())
        if self.world_size not in (0, ranks):
            raise InvalidArgument.value("world_size", self.world_size, f"{' * '.join(self.sizes)} = {ranks}, or left out")
        object.__setattr__(self, "world_size", ranks)
        super().__post_init__()
        expect_import_paths(self, "fn", "parallelizer", "gatherer")
        self._expect_declared_groups()

    def _expect_declared_groups(self) -> None:
        """A declared kind's group is a dimension of this mesh, the whole world, or a team's own sub-group by its ranks
        (``ranks_0_1``): a dimension the mesh lacks would only be judged wrong at run time."""
        for kind in self.declared_collectives() or {}:
            group = kind.partition("[")[2].rstrip("]")
            if group and group not in (*self.sizes, "world") and not (
                    group.startswith(SUB_GROUP_PREFIX) and group[len(SUB_GROUP_PREFIX):].replace("_", "").isdigit()):
                raise InvalidArgument(
                    f"collectives={self.collectives!r} is not allowed: {kind!r} names {group!r}, expected a dimension "
                    f"of this mesh ({', '.join(map(repr, self.sizes))}), 'world', or a sub-group by its ranks "
                    f"('{SUB_GROUP_PREFIX}0_1')")

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's dimensions by name, in its layout: dp and tp, and ep and cp between them where above 1."""
        return {name: getattr(self, name) for name in MESH_DIMENSIONS
                if name not in OPTIONAL_DIMENSIONS or getattr(self, name) > 1}

    def count_communication(self, module):
        """Every collective of a step by kind and mesh dimension (``"all_reduce[tp]"``), as the TP regimes count; a
        group is named by the dimension of this mesh whose ranks it spans, whatever made it (DTensor, the team's own
        collectives)."""
        return attach_mesh_counter(module, layout=self.sizes)

    def read_back(self, named: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's tensors under the case's names first (the team's name map, where its parallelize returned one).
        With the team's gather: every name of the case's model, on every rank in one order, each whole from what
        this rank holds under that name, or None where it holds none of it (experts that live on another rank): a
        gather made of collectives meets its peers. Without one: each tensor this rank holds, whole, and each that
        only some ranks hold broadcast from the first of them."""
        local_names = getattr(self, "_local_names", None)
        if local_names:
            named = {local_names.get(name, name): tensor for name, tensor in named.items()}
        names = getattr(self, "_case_names", None)
        if names is not None and self.gatherer:
            return {name: self.full_tensor(named.get(name), name) for name in names}
        holders = getattr(self, "_holders", None)
        if not holders:
            return super().read_back(named)
        whole = {name: self.full_tensor(tensor, name) for name, tensor in named.items() if name not in holders}
        device = next(iter(named.values())).device
        with uncounted(), torch.no_grad():  # the harness's read-back: no collective of the team's step
            for name in (name for name in names if name in holders):  # every rank in one order
                shape, dtype = self._case_shapes[name]
                mine = named.get(name)
                held = (mine.detach().clone() if mine is not None
                        else torch.empty(shape, dtype=dtype, device=device)).contiguous()
                dist.broadcast(held, src=holders[name])
                whole[name] = held
        return whole

    def full_tensor(self, tensor: Tensor | None, name: str = "") -> Tensor:
        """A DTensor through ``full_tensor()``; a plain tensor (or None: this rank holds none of it) through the team's
        gather where it hands one over (its own layers' local shards), else as it is (a replica)."""
        if not self.gatherer or (tensor is not None and is_dtensor(tensor) and self.pp == 1):
            return super().full_tensor(tensor, name)
        with uncounted():  # the harness's read-back, in the team's words: no collective of its step
            whole = resolve(self.gatherer)(name, tensor)
        if not isinstance(whole, Tensor):
            raise InvalidArgument(f"gather {self.gatherer!r} returned a {type(whole).__name__} for {name!r}: expected "
                                  "the whole tensor (a torch.Tensor)")
        return whole

    def wrap(self, model, objective):
        from torch.distributed.device_mesh import init_device_mesh

        quiet_read_back()  # the team's own warnings stay: only the harness's read-back of a 2-D DTensor is quieted
        mesh = init_device_mesh(next(model.parameters()).device.type, tuple(self.sizes.values()),
                                mesh_dim_names=tuple(self.sizes))
        # The names the reference gives: read back (with the team's gather) whatever this rank's layers hold. Set on
        # this run's own regime (parsed afresh for every job); no field of its spec.
        object.__setattr__(self, "_case_names", [name for name, _ in model.named_parameters()])
        object.__setattr__(self, "_case_shapes", {name: (p.shape, p.dtype) for name, p in model.named_parameters()})
        made = resolve(self.parallelizer)(model, mesh)
        made, local_names = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(made, nn.Module):
            raise InvalidArgument(f"parallelize {self.parallelizer!r} returned a {type(made).__name__}: expected the "
                                  "model (an nn.Module), its plan applied, or (model, names): names maps this rank's "
                                  "parameter names to the case's model's (local experts numbered from 0 on every rank)")
        self._hold_by_names(made, local_names)
        return made

    def _hold_by_names(self, made: nn.Module, local_names: object) -> None:
        """The team's map of this rank's parameter names to the case's, checked; and which ranks hold each name that
        not every rank holds (one gather of the names, the harness's): those are broadcast from the first holder."""
        own = [name for name, _ in made.named_parameters()]
        if local_names is not None:
            if not isinstance(local_names, Mapping) or not set(local_names) <= set(own) or not set(
                    local_names.values()) <= set(self._case_names):
                raise InvalidArgument.value(
                    "names", local_names, "a dict of this rank's parameter names (of the model parallelize returns) "
                    "to the case's model's, as parallelize's (model, names) ({'experts.0.weight': 'experts.2.weight'} "
                    "on the rank that holds the case's expert 2 as its local expert 0)")
            object.__setattr__(self, "_local_names", dict(local_names))
            own = [local_names.get(name, name) for name in own]
        if self.gatherer or self.pp > 1:  # the team's gather reads back what each rank holds; a stage holds its own
            return
        every: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        with uncounted():
            dist.all_gather_object(every, own)
        held_by = {name: [rank for rank, names in enumerate(every) if name in names] for name in self._case_names}
        nowhere = [name for name, ranks in held_by.items() if not ranks]
        if nowhere and local_names is not None:
            raise InvalidArgument(f"parallelize {self.parallelizer!r}: no rank holds {', '.join(nowhere[:5])} of the "
                                  "case's model under the names its (model, names) maps to")
        object.__setattr__(self, "_holders", {name: ranks[0] for name, ranks in held_by.items()
                                              if ranks and len(ranks) < len(every)})

    @property
    def shards(self) -> tuple[str, int]:
        """A global batch is cut over the mesh's data groups (``dp`` x ``ep``), not its ranks."""
        return " * ".join(d for d in DATA_DIMENSIONS if d in self.sizes), self.dp * self.ep

    def rank_shard(self, batch: Batch) -> Batch:
        """This rank's data shard: the same for every rank of one TP group (and of one CP group, and every stage)."""
        group = dist.get_rank() % (self.dp * self.ep * self.cp * self.tp) // (self.cp * self.tp)
        return shard(batch, group, self.dp * self.ep)

    def train(self, model, optimizer, batches, objective):
        """As on DDP ranks; on a pipeline, each step's loss the mean of what the ranks that have one returned."""
        if self.pp == 1:
            return DdpStep.train(self, model, optimizer, batches, objective)
        step = fresh_step(resolve(self.fn), self.per_run)
        return stage_losses([step(model, optimizer, (mine.inputs, mine.targets))
                             for mine in (self.team_shard(batch) for batch in batches)], mean=True)

    # A team's step, its shards and its loss's share as on DDP ranks; the shard is this rank's data-parallel one.
    team_shard = DdpStep.team_shard
    share = DdpStep.share


@dataclasses.dataclass(frozen=True)
class MeshLoop(MeshStep):
    """The team's own loop on a mesh: each global batch reaches it as its TP group's data-parallel shard."""

    name = "mesh_loop"
    summary = "a team's own training loop on a dp x tp mesh, its own parallelize(model, mesh) applied first"
    steps_observable = False
    train = DdpLoop.train


def stage_losses(returned: Sequence[object], mean: bool = False) -> list[float | None]:
    """Each step's loss as dispatch adds the ranks' shares up: what the ranks returned, added (only the last
    stage has a loss; the others return 0 or None), or with ``mean`` the mean of those that returned one (the last
    stage's ranks on a mesh, each its data-parallel group's mean), reported by rank 0, the others' share 0; None
    where no rank returned one. One gather of the ranks' losses after the run, the harness's: left out of the
    counts."""
    mine = [None if loss is None else float(loss) for loss in returned]
    every: list[list[float | None]] = [[] for _ in range(dist.get_world_size())]
    with uncounted():
        dist.all_gather_object(every, mine)
    given = [[loss for loss in step if loss is not None] for step in zip(*every)]
    added = [None if not losses else sum(losses) / (len(losses) if mean else 1) for losses in given]
    return added if dist.get_rank() == 0 else [None if loss is None else 0.0 for loss in added]
