"""Pipeline x FSDP2 x tensor parallelism on a three-dimensional mesh, as torchtitan composes them:
``pp_fsdp_tp:pp=P,dp=D,tp=T[,microbatches=K]`` on P x D x T ranks (row-major: one TP group's ranks consecutive, the
pipeline outermost).

The case's ``nn.Sequential`` is cut into P stages as ``pipeline`` cuts it; on each stage's ranks the case's plan
(``tp_plan``, or one derived) is applied over ``tp`` to that stage's modules and FSDP2 shards its blocks over ``dp``;
a GPipe schedule of K micro-batches drives the stages over ``pp``. Each data-parallel group (its P x T ranks) is handed
its shard of the global batch, which the schedule cuts into K equal micro-batches. A micro-batch's loss is its share of
the global batch's objective times D (FSDP2 averages over ``dp``), with ``scale_grads=False``.

Every rank builds the whole model; a stage's parameters are DTensors on its own ranks only. A weight or gradient is
read back whole on its stage (``full_tensor()``) and broadcast over ``pp`` from that stage's rank (the harness's
read-back, left out of the counts), so every rank reports the whole model. A plan whose colwise and rowwise halves
would fall in two stages, or micro-batches that cannot be equal, are refused before anything trains.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from ..case import Case
from ..device import DEFAULT_DEVICE
from ..errors import InvalidArgument, expect_int
from ..measure.collectives import attach_mesh_counter
from ..process.seeding import DEFAULT_SEED, seeded
from ..process.torch_imports import fsdp2, fsdp2_missing
from .base import SCALED_TWICE, Pitfall, Regime, finish_step
from .ddp import Distributed, set_mesh_world_size, shard, whole_from
from .pipeline import Pipeline, Pipelined, stage_bounds
from .tensor import _quiet_mesh_warnings, applied_plan, plan_for


@dataclasses.dataclass(frozen=True)
class PipelineFsdpTensorParallel(Distributed):
    name = "pp_fsdp_tp"
    summary = ("a pp x dp x tp mesh as torchtitan composes it: the case's Sequential cut into pp stages (a GPipe "
               "schedule of K micro-batches), each stage's plan over tp and its blocks sharded by FSDP2 over dp")
    syncs_per_step = None  # every collective counted by kind and mesh dimension
    fits_some_cases = True  # an nn.Sequential of blocks whose tensor-parallel pairs each stay within a stage
    # torch's scale_grads: True divides the micro-batches' summed gradients by K after the last backward.
    scale_grads: ClassVar[bool] = False
    world_size: int = dataclasses.field(default=0, metadata={"derived": "pp * dp * tp"})
    pp: int = dataclasses.field(kw_only=True)
    dp: int = dataclasses.field(kw_only=True)
    tp: int = dataclasses.field(kw_only=True)
    microbatches: int = dataclasses.field(default=2, kw_only=True)

    def __post_init__(self) -> None:
        set_mesh_world_size(self, ("pp", "dp", "tp"))
        expect_int("microbatches", self.microbatches)
        super().__post_init__()

    @property
    def layout(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    placement = Pipeline.placement  # gloo ranks on the CPU, as every pipeline regime here
    micro_batches = Pipeline.micro_batches

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        return Pipeline.unavailable(self, device) or fsdp2_missing()

    def validate(self, case: Case) -> None:
        Regime.validate(self, case)
        shard_size, left = divmod(case.batch_size, self.dp)
        if left or shard_size % self.microbatches or case.last_batch != "exact":
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: batch_size={case.batch_size} is not allowed: expected "
                f"every global batch cut into dp={self.dp} equal shards of microbatches={self.microbatches} equal "
                "micro-batches (torch.distributed.pipelining sends buffers shaped by the first one)")
        if case.forward is not None:
            raise InvalidArgument(f"regime {str(self)!r} on case {case.name!r}: the case calls its model through "
                                  "forward=, which a pipeline cannot cut: expected model(inputs), an nn.Sequential")
        with seeded(DEFAULT_SEED):
            model = case.model()
        self.stage_of(model, plan_for(case, model, self.tp), case.name)

    def stage_of(self, model: nn.Module, plan: dict[str, str], case_name: str) -> dict[str, int]:
        """Each top-level child's stage, by its name; InvalidArgument where the model cannot be cut into ``pp``
        stages, or a colwise module and the rowwise one after it fall in two stages (a sharded activation would
        cross the pipeline)."""
        children = [name for name, _ in model.named_children()] if isinstance(model, nn.Sequential) else []
        if len(children) < self.pp:
            raise InvalidArgument(f"regime {str(self)!r} on case {case_name!r}: the case's model cannot be cut into "
                                  f"pp={self.pp} stages: expected an nn.Sequential of at least {self.pp} blocks")
        stages = {children[i]: stage for stage, (start, stop) in enumerate(stage_bounds(len(children), self.pp))
                  for i in range(start, stop)}
        opened = None
        for name, style in plan.items():  # in the model's order: each colwise closed by the rowwise after it
            if style.startswith("colwise"):
                opened = name
            elif style == "rowwise" and opened is not None:
                if stages[opened.split(".")[0]] != stages[name.split(".")[0]]:
                    raise InvalidArgument(
                        f"regime {str(self)!r} on case {case_name!r}: the tensor-parallel pair {opened} (colwise) and "
                        f"{name} (rowwise) would fall in two pipeline stages: expected an nn.Sequential of blocks, "
                        "each holding its pairs")
                opened = None
        return stages

    def count_communication(self, module):
        return attach_mesh_counter(module, layout=self.layout)

    def wrap(self, model: nn.Module, objective) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        _quiet_mesh_warnings()
        mesh = init_device_mesh(next(model.parameters()).device.type, tuple(self.layout.values()),
                                mesh_dim_names=tuple(self.layout))
        plan = plan_for(objective.case, model, self.tp)
        stages = self.stage_of(model, plan, objective.case.name)
        stage = mesh["pp"].get_local_rank()
        mine = [child for name, child in model.named_children() if stages[name] == stage]
        applied_plan(model, mesh["tp"], {name: style for name, style in plan.items()
                                         if stages[name.split(".")[0]] == stage}, self.tp)
        for block in mine:
            if any(True for _ in block.parameters()):
                fsdp2().fully_shard(block, mesh=mesh["dp"])
        piece = fsdp2().fully_shard(nn.Sequential(*mine), mesh=mesh["dp"])
        piped = PipelineStage(piece, stage, self.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        pipelined = Pipelined(model, [piped], [])
        pipelined.schedule = ScheduleGPipe(piped, self.microbatches, loss_fn=self.loss_fn(objective, pipelined),
                                           scale_grads=self.scale_grads)
        object.__setattr__(self, "_stages", (stages, stage, mesh["pp"].get_group()))  # this rank's run's
        return pipelined

    def loss_fn(self, objective, model: Pipelined):
        """A micro-batch's share of the global batch's objective, times dp (FSDP2 averages over dp)."""
        return lambda output, targets: objective.share(output, targets, model.batch) * self.dp

    def rank_shard(self, batch):
        """This rank's data-parallel shard: the same on every rank of its TP group and every stage."""
        return shard(batch, dist.get_rank() % (self.dp * self.tp) // self.tp, self.dp)

    def train_step(self, model: Pipelined, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        model.batch = batch
        losses: list[Tensor] = []
        model.schedule.step(*((mine.inputs,) if model.first else ()), target=mine.targets if model.last else None,
                            losses=losses, return_outputs=False)
        finish_step(optimizer, objective)
        if not model.last:
            return torch.zeros(())
        return torch.stack([loss.detach() for loss in losses]).sum() / (self.dp * self.tp)  # dispatch adds the shares

    def full_tensor(self, tensor: Tensor, name: str = "") -> Tensor:
        """Whole on its stage's ranks, then broadcast over pp from that stage's rank: every rank reports the whole
        model."""
        stages, stage, group = getattr(self, "_stages", (None, None, None))
        owner = stages.get(name.split(".")[0]) if stages is not None else None
        if owner is None:
            return super().full_tensor(tensor, name)
        return whole_from(owner, group, tensor)


@dataclasses.dataclass(frozen=True)
class PipelineFsdpTensorParallelScaledTwice(PipelineFsdpTensorParallel):
    name = "pp_fsdp_tp_scaled_twice"
    summary = ("PITFALL: on the pp x dp x tp mesh, the faithful share of each micro-batch left with the schedule's "
               "scale_grads=True: every gradient divided by the micro-batch count once more")
    pitfall = Pitfall(SCALED_TWICE, twin="pp_fsdp_tp")
    scale_grads = True


@dataclasses.dataclass(frozen=True)
class PipelineFsdpTensorParallelRanksDiffer(PipelineFsdpTensorParallel):
    name = "pp_fsdp_tp_ranks_differ"
    summary = ("PITFALL: on the pp x dp x tp mesh, each TP rank shuffles its group's shard by a seed of its own: the "
               "ranks of one TP group compute on different micro-batches")
    pitfall = Pitfall("tensor-parallel ranks fed different batches", twin="pp_fsdp_tp")

    def rank_shard(self, batch):
        mine = super().rank_shard(batch)
        order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(dist.get_rank() % self.tp))
        return dataclasses.replace(mine, inputs=mine.inputs[order], targets=mine.targets[order])
