"""Pipeline parallelism with ``torch.distributed.pipelining``: the model cut into stages, one rank per stage.

``pipeline:stages=S,microbatches=K,schedule=gpipe|1f1b|interleaved`` runs on S ranks (world_size = S). The
case's model must be an ``nn.Sequential``; its direct children are cut into contiguous stages, evenly by
count, the first stages taking one more where they do not divide (5 children in 2 stages: 3, 2; the rule of
``torch.tensor_split``). ``gpipe`` (ScheduleGPipe) and ``1f1b`` (Schedule1F1B) give each rank one stage;
``interleaved`` (ScheduleInterleaved1F1B) gives each rank two, S * 2 in all, rank r holding stages r and r + S
(the looped placement the schedule expects). A model with fewer children than stages, or that is not an
``nn.Sequential``, or a case with its own ``forward=``, cannot be cut: :class:`InvalidArgument` names the case.
A weight tied across stages (an input embedding that is also the output layer's weight) is held by every stage that
uses it, each rank its own copy; after the schedule, the copies' gradients are all-reduced between the ranks holding
them (Megatron's embedding group, DeepSpeed's ``allreduce_tied_weight_gradients``), so each holds both uses' sum.

``max_norm=M`` clips the whole gradient to M before the step as a pipeline computes its norm: each rank's squares of
the gradients its stages hold, a tied weight's on the first of its stages alone, summed over the ranks (one
all-reduce); every rank scales what it holds by the one coefficient. ``pipeline_clip_tied_per_stage`` counts a tied
weight on every stage holding it (NVIDIA/Megatron-LM pull #7227's, deepspeedai/DeepSpeed pull #1252's class).

The schedule cuts each global batch into K micro-batches with ``tensor_split``. PipelineStage infers the
shapes it sends from the first micro-batch and reuses its buffers, so in torch 2.13 every micro-batch must hold
the same number of samples: K must divide every global batch (an uneven one fails inside the schedule with a
shape error; here it is a usage error before anything trains).

How the whole model is reported: every rank builds the whole model (the same seeded start as full batch);
each stage module is built from that rank's own children, which share their parameters with the whole model.
After the schedule's step, the owner of each stage broadcasts that stage's gradients (and buffers,
BatchNorm's running statistics) to every rank, so every rank holds the FULL gradient when its optimizer steps:
``GradRecorder`` records it there, every rank steps the same full gradients with the same optimizer, and the
weights stay identical on every rank without another collective (``full_tensor`` is the identity; the harness
checks the ranks' spread). The extra broadcast is the harness's, not pipelining's, and only reports: what
trains is the schedule.

The loss: the schedule's ``loss_fn`` sees one micro-batch's output and targets. The faithful loss is that
micro-batch's loss *sum* over the item count of the *global* batch (which the step sets on :class:`Pipelined`
before the schedule runs, for torch 2.11's ``schedule.step()`` takes no ``loss_kwargs``), with
``scale_grads=False``: the micro-batches' gradients then add up to the full-batch mean's, however the items fall.
The pitfall twin, ``pipeline_mean_loss``, is the pairing torch's docstring suggests (``loss_fn`` a per-micro-batch
*mean*, ``scale_grads=True`` dividing by K): right only when every micro-batch holds as many items, so it is
caught where equal micro-batches of samples hold unequal numbers of tokens. ``pipeline_scaled_twice`` is the
global-sum loss left with the default ``scale_grads=True``: every gradient 1/K too small.

Only the last stage computes losses; its rank reports the step's loss, the others a share of 0 (dispatch adds
the ranks' shares). Runs on the CPU over gloo: nccl and CUDA precision modes are skipped with that reason.
Communication is counted by kind, ``send`` and ``recv`` (every ``isend``/``irecv`` of activations and their
gradients, and on the first step the shape metadata; torch 2.15's schedule also all-reduces twice on its first
step, 4 bytes each, setting its stages up), never as a gradient sync (there is none); the harness's
broadcast of each stage's gradients is left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..case import Batch, Case, Objective
from ..device import BACKENDS, DEFAULT_DEVICE, RankPlacement
from ..errors import InvalidArgument, expect_int
from ..measure.collectives import StepTraffic, uncounted
from .base import (SCALED_TWICE, CommunicationCounter, Pitfall, Regime, expect_max_norm, finish_step, scale_to,
                   squared_norm)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
TIED_CLIPPED_PER_STAGE = "clipping by a norm that counts a tied weight on every stage (PP)"


def stage_bounds(children: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) child ranges of ``stages`` stages, evenly by count, the first ones longer."""
    size, extra = divmod(children, stages)
    bounds, start = [], 0
    for index in range(stages):
        stop = start + size + (index < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class Pipelined(nn.Module):
    """What ``train_step`` drives: the whole model, this rank's stages of it and the schedule over them."""

    def __init__(self, model: nn.Module, stages: list, owners: list[tuple[int, nn.Module]],
                 tied: Sequence[TiedWeight] = ()) -> None:
        super().__init__()
        self.model = model
        self.stages = stages  # PipelineStage objects (not modules): this rank's
        self.owners = owners  # (rank owning it, stage module) for every stage, in order
        self.tied = tied  # the weights two or more stages hold (Pipeline.reduce_tied sums their gradients)
        self.schedule = None  # set by Pipeline.wrap: its loss reads the batch
        self.batch: Batch | None = None  # the global batch the schedule is running

    def held(self) -> list[nn.Parameter]:
        """The parameters this rank's stages hold, each once."""
        mine = {id(stage.submod): stage.submod for stage in self.stages}
        return list({id(p): p for module in mine.values() for p in module.parameters() if p.requires_grad}.values())

    @property
    def first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def share_stages(self) -> None:
        """Each stage's owner broadcasts its gradients and buffers: every rank then holds them all, whole."""
        broadcast_gradients((owner, param) for owner, module in self.owners
                            for param in module.parameters() if param.requires_grad)
        with uncounted():  # the harness's traffic, for the report: not the pipeline's
            for owner, module in self.owners:
                for buffer in module.buffers():
                    dist.broadcast(buffer.data, src=owner)


@dataclasses.dataclass
class TiedWeight:
    """A parameter two or more stages hold: the ranks owning those stages (the first stage's first) and the process
    group over them (None where one rank holds every such stage)."""

    parameter: nn.Parameter
    ranks: tuple[int, ...]
    group: object | None


def tied_across(stages: list[nn.Module]) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    """Each parameter held by more than one stage, with those stages' indices, in the model's order."""
    held: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for index, stage in enumerate(stages):
        for parameter in stage.parameters():
            entry = held.setdefault(id(parameter), (parameter, []))
            if index not in entry[1]:
                entry[1].append(index)
    return [(parameter, tuple(indices)) for parameter, indices in held.values() if len(indices) > 1]


def broadcast_gradients(owned: Iterable[tuple[int | None, nn.Parameter]]) -> None:
    """Each parameter's gradient broadcast from the rank that owns it (its stage's) to every rank, so that every
    rank holds and steps the whole gradient; the owner's missing one as zeros, a parameter no rank owns (None)
    left as it is. The harness's traffic, for the report: left out of the counts."""
    rank = dist.get_rank()
    with uncounted():
        for owner, param in owned:
            if owner is None:
                continue
            if owner == rank:
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
            else:
                grad = torch.empty_like(param)
            dist.broadcast(grad, src=owner)
            param.grad = grad


def gradient_owners(parameters: Sequence[nn.Parameter]) -> list[int | None]:
    """The rank that holds each parameter's gradient after a pipeline's step, where the harness did not cut the
    stages (a team's own step): the first rank whose gradient is nonzero, else the first that holds one (zeros
    where ``zero_grad(set_to_none=False)`` keeps them), else None. One all-gather of a flag per parameter."""
    held = torch.tensor([0 if p.grad is None else 1 + bool(p.grad.any()) for p in parameters], dtype=torch.int32)
    every = [torch.empty_like(held) for _ in range(dist.get_world_size())]
    with uncounted():
        dist.all_gather(every, held)
    flags = torch.stack(every)  # ranks x parameters
    best = flags.argmax(dim=0)  # the first rank with the highest flag
    return [int(rank) if flags[rank, index] else None for index, rank in enumerate(best.tolist())]


def share_team_gradients(parameters: Sequence[nn.Parameter]) -> None:
    """Every gradient a team's pipeline step left on its stages' ranks, broadcast to every rank from its owner."""
    broadcast_gradients(zip(gradient_owners(parameters), parameters))


@dataclasses.dataclass(frozen=True)
class Pipeline(Regime):
    name = "pipeline"
    summary = ("S ranks, one contiguous stage of an nn.Sequential each (interleaved: two), K equal micro-batches; "
               "loss_fn = micro-batch sum / global items, scale_grads=False")
    distributed = True
    # torch's scale_grads: True divides the micro-batches' summed gradients by K after the last backward.
    scale_grads: ClassVar[bool] = False

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    backend: str = "auto"
    max_norm: float = dataclasses.field(default=math.inf, kw_only=True, metadata={"trailing": True})

    def __post_init__(self) -> None:
        expect_max_norm(self.max_norm)
        expect_int("stages", self.stages, minimum=1)
        expect_int("microbatches", self.microbatches, minimum=1)
        if self.schedule not in SCHEDULES:
            raise InvalidArgument.value("schedule", self.schedule, f"one of {', '.join(SCHEDULES)}")
        if self.backend not in BACKENDS:
            raise InvalidArgument.value("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise InvalidArgument(
                f"regime {str(self)!r}: microbatches={self.microbatches} is not allowed with schedule=1f1b: expected "
                f"an integer >= stages={self.stages} (Schedule1F1B refuses fewer micro-batches than stages)")
        if self.schedule == "interleaved":
            rounds = max(1, self.microbatches // self.stages)
            if self.microbatches % rounds:
                raise InvalidArgument(
                    f"regime {str(self)!r}: microbatches={self.microbatches} is not allowed with schedule=interleaved "
                    f"and stages={self.stages}: ScheduleInterleaved1F1B needs a multiple of its rounds "
                    f"(max(1, microbatches // stages) = {rounds}): e.g. microbatches={self.stages} or "
                    f"{2 * self.stages}")

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.stages

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    def placement(self, device: str) -> RankPlacement:
        """Gloo ranks on the CPU whatever the check's device: a pipeline's stages over nccl are not measured here."""
        return RankPlacement("gloo", "" if device == "cpu" else
                             "pipeline regimes run on the CPU over gloo only: its stages train on the CPU")

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        if self.backend == "nccl":
            return "pipeline regimes run on the CPU over gloo only (nccl is not measured here)"
        return None

    def micro_batches(self, case: Case) -> int:
        return self.microbatches

    def validate(self, case: Case) -> None:
        super().validate(case)
        if case.batch_size % self.microbatches:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: microbatches={self.microbatches} is not allowed: "
                f"expected a divisor of batch_size={case.batch_size} (torch.distributed.pipelining sends "
                "buffers shaped by the first micro-batch, so every micro-batch must hold as many samples)")
        if case.forward is not None:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: the case calls its model through forward=, which a "
                "pipeline cannot cut: expected a case whose model(inputs) is an nn.Sequential of stages")
        with torch.random.fork_rng(devices=[]):
            model = case.model()
        self.cut(model, case.name)

    def cut(self, model: nn.Module, case_name: str = "?") -> list[nn.Module]:
        """The model's stages: contiguous runs of its children, evenly by count (see the module's docstring)."""
        total = self.stages * self.stages_per_rank
        children = list(model.children()) if isinstance(model, nn.Sequential) else []
        if not isinstance(model, nn.Sequential) or len(children) < total:
            what = (f"an nn.Sequential of {len(children)} children" if isinstance(model, nn.Sequential)
                    else f"a {type(model).__name__}, not an nn.Sequential")
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case_name!r}: the case's model cannot be cut into {total} pipeline "
                f"stages: it is {what}; expected an nn.Sequential with at least {total} children (stages="
                f"{self.stages}{' x 2 per rank' if self.stages_per_rank == 2 else ''}), cut evenly by count")
        return [nn.Sequential(*children[start:stop]) for start, stop in stage_bounds(len(children), total)]

    def clips_at(self) -> float | None:
        return self.max_norm if self.max_norm < math.inf else None

    def count_communication(self, module: nn.Module) -> CommunicationCounter:
        """The schedule's sends and receives (no gradient sync: stages exchange activations)."""
        return StepTraffic(None)

    def loss_fn(self, objective: Objective):
        """A micro-batch's loss from its output, its targets and the global batch: its share of that batch's
        objective."""
        return lambda output, targets, batch: objective.share(output, targets, batch)

    def schedule_loss(self, objective: Objective, model: Pipelined):
        """The loss as the schedule calls it, on a micro-batch's output and targets alone: :meth:`loss_fn` with the
        global batch ``model`` runs. torch 2.11's ``schedule.step()`` has no ``loss_kwargs`` (it hands extra
        keywords to the first stage's forward), so the batch is read from ``model``, not passed."""
        loss_fn = self.loss_fn(objective)
        return lambda output, targets: loss_fn(output, targets, model.batch)

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        rank, world = dist.get_rank(), dist.get_world_size()
        if world != self.stages:
            raise InvalidArgument(f"regime {str(self)!r}: stages={self.stages} needs a world of {self.stages} "
                                  f"ranks: this one has {world}")
        modules = self.cut(model)  # validate() named the case where this fails
        device = next(model.parameters()).device
        owners = [(index % self.stages, module) for index, module in enumerate(modules)]
        mine = [PipelineStage(modules[index], index, len(modules), device)
                for index in range(rank, len(modules), self.stages)]
        tied = []
        for parameter, indices in tied_across(modules):  # every rank makes each group, in the same order
            ranks = tuple(dict.fromkeys(index % self.stages for index in indices))
            tied.append(TiedWeight(parameter, ranks, dist.new_group(sorted(ranks)) if len(ranks) > 1 else None))
        pipelined = Pipelined(model, mine, owners, tied)
        loss_fn = self.schedule_loss(objective, pipelined)
        if self.schedule == "interleaved":
            pipelined.schedule = ScheduleInterleaved1F1B(mine, self.microbatches, loss_fn=loss_fn,
                                                         scale_grads=self.scale_grads)
        else:
            kind = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
            pipelined.schedule = kind(mine[0], self.microbatches, loss_fn=loss_fn, scale_grads=self.scale_grads)
        return pipelined

    def train_step(self, model: Pipelined, optimizer, batch: Batch, objective: Objective) -> Tensor:
        if len(batch) % self.microbatches:
            raise InvalidArgument(
                f"regime {str(self)!r}: a global batch of {len(batch)} samples cannot be cut into "
                f"microbatches={self.microbatches} equal micro-batches (torch.distributed.pipelining needs equal "
                "ones): expected microbatches to divide every global batch, the last one included")
        losses: list[Tensor] = []
        model.batch = batch
        model.schedule.step(*((batch.inputs,) if model.first else ()),
                            target=batch.targets if model.last else None, losses=losses, return_outputs=False)
        self.reduce_tied(model)
        if self.max_norm < math.inf:
            scale_to(optimizer, self.max_norm, self.total_norm(model))
        model.share_stages()
        finish_step(optimizer, objective)
        return self.reported(losses) if model.last else torch.zeros(())

    def reported(self, losses: list[Tensor]) -> Tensor:
        """The step's loss from the micro-batches' losses: their sum (each is its share of the global mean)."""
        return torch.stack([loss.detach() for loss in losses]).sum()

    def reduce_tied(self, model: Pipelined) -> None:
        """Each tied weight's gradient summed over the ranks holding it (a copy a rank's stages never used: zeros)."""
        rank = dist.get_rank()
        for tied in model.tied:
            if tied.group is not None and rank in tied.ranks:
                grad = tied.parameter.grad if tied.parameter.grad is not None else torch.zeros_like(tied.parameter)
                dist.all_reduce(grad, group=tied.group)
                tied.parameter.grad = grad

    def total_norm(self, model: Pipelined) -> Tensor:
        """The whole gradient's norm: each rank's squares of what its stages hold (a tied weight's counted by the
        rank of its first stage alone), summed over the ranks."""
        rank, tied = dist.get_rank(), {id(t.parameter): t.ranks for t in model.tied}
        counted = [p.grad for p in model.held() if p.grad is not None and self.counts(tied.get(id(p)), rank)]
        squares = squared_norm(counted, next(model.model.parameters()))
        dist.all_reduce(squares)
        return squares.sqrt()

    def counts(self, holders: tuple[int, ...] | None, rank: int) -> bool:
        """Whether ``rank`` counts a weight held by the ranks ``holders`` (None: by its stage's rank alone) in the
        norm: each weight once, on the first holder."""
        return holders is None or holders[0] == rank


@dataclasses.dataclass(frozen=True)
class PipelineMeanLoss(Pipeline):
    name = "pipeline_mean_loss"
    summary = ("PITFALL: loss_fn = micro-batch mean, scale_grads=True (torch's pairing): wrong when micro-batches "
               "hold unequal item counts")
    pitfall = Pitfall("token normalisation across micro-batches", twin="pipeline")
    scale_grads = True

    def loss_fn(self, objective: Objective):
        return lambda output, targets, batch: objective.mean(output, targets)

    def reported(self, losses: list[Tensor]) -> Tensor:
        return torch.stack([loss.detach() for loss in losses]).mean()


@dataclasses.dataclass(frozen=True)
class PipelineScaledTwice(Pipeline):
    name = "pipeline_scaled_twice"
    summary = "PITFALL: loss_fn = micro-batch sum / global items, left with scale_grads=True: gradients 1/K too small"
    pitfall = Pitfall(SCALED_TWICE, twin="pipeline")
    scale_grads = True


@dataclasses.dataclass(frozen=True)
class PipelineClipTiedPerStage(Pipeline):
    name = "pipeline_clip_tied_per_stage"
    summary = "PITFALL: clipping by a norm that counts a weight tied across stages on every stage holding it"
    pitfall = Pitfall(TIED_CLIPPED_PER_STAGE, twin="pipeline")

    def counts(self, holders: tuple[int, ...] | None, rank: int) -> bool:
        return True
