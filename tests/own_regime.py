"""A team's own regimes, in one module and nowhere else: registering them here is all it takes for
equivcheck to run them in-process, on the worker pool (whose ranks import this module by name) and
in the pitfall catalogue."""

import dataclasses

import equivcheck as ec
from equivcheck.regimes import Chunked, accumulate, register_regime
from equivcheck.regimes.ddp import Ddp


@register_regime
@dataclasses.dataclass(frozen=True)
class ReversedAccumulate(Chunked):
    name = "reversed_accumulate"
    summary = "accumulate the micro-batches last to first: the sum does not care about the order"

    def train_step(self, model, optimizer, batch, objective):
        backwards = ec.Batch(batch.inputs.flip(0), batch.targets.flip(0), batch.count)
        return accumulate(model, optimizer, backwards, objective, self.chunks)


@register_regime
@dataclasses.dataclass(frozen=True)
class DdpHalvedLoss(Ddp):
    name = "ddp_halved_loss"
    summary = "PITFALL: each rank halves its loss once more (a 'DDP averages, so divide' misunderstanding)"
    pitfall = ec.Pitfall("loss scaled by 1 / K twice", twin="ddp")  # its class of bug, and the regime done right

    def rank_part(self, objective, batch):
        share = super().rank_part(objective, batch)
        return lambda output, targets: share(output, targets) / 2


CASE = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="own_regime_mlp", regimes=None,
    expect_mismatch={"ddp_halved_loss": "every rank's gradient is half of what it should be"},
))
