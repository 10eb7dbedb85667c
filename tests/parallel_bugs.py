"""Real bugs under FSDP2 and ZeRO, the twins of its equivalent verdicts: registered here, imported by the ranks by name."""

import dataclasses

from equivcheck.regimes import register_regime
from equivcheck.case import ModelParameters
from equivcheck.regimes.fsdp import FsdpNoSync, gradient_sync_off
from equivcheck.regimes.ddp import Ddp
from equivcheck.regimes.pipeline import Pipeline
from equivcheck.regimes.zero import Zero


@register_regime
@dataclasses.dataclass(frozen=True)
class FsdpSyncNever(FsdpNoSync):
    name = "fsdp_sync_never"
    summary = "PITFALL: gradient sync turned off for every micro-batch, the last one too: nothing is reduce-scattered"
    pitfall = True

    def sync_context(self, model, last):
        return gradient_sync_off(model)


@register_regime
@dataclasses.dataclass(frozen=True)
class ZeroDefaultHyperparameters(Zero):
    name = "zero_default_hyperparameters"
    summary = "PITFALL: ZeroRedundancyOptimizer given the optimizer class alone: its lr and momentum are lost"
    pitfall = True

    def build_optimizer(self, case, model):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = case.optimizer(ModelParameters(model))
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(optimizer), lr=0.01)


@register_regime
@dataclasses.dataclass(frozen=True)
class DdpForgetsTheWorldSize(Ddp):
    name = "ddp_forgets_the_world_size"
    summary = "PITFALL: a rank's loss sum over the global items, not times W: DDP's average is 1/W too small"
    pitfall = True

    def rank_part(self, objective, batch):
        return lambda output, targets: objective.sum(output, targets) / batch.items


@register_regime
@dataclasses.dataclass(frozen=True)
class PipelineTiedUnreduced(Pipeline):
    name = "pipeline_tied_unreduced"
    summary = "PITFALL: a weight tied across stages left with each stage's own use of it: never summed between them"
    pitfall = True

    def reduce_tied(self, model):
        return None
