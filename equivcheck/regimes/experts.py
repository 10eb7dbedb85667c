"""Mixture-of-experts pitfalls: the aux terms of a case's objective (:class:`equivcheck.case.Term`: a load-balancing
loss, a router z-loss) normalised wrong across data-parallel ranks, while the main loss is right.

DDP averages the ranks' gradients, so a rank's loss is its share of the global objective times the world size
(:meth:`Ddp.rank_part`); teams that add the aux term after that scaling, or scale it again, train the router at
another strength than one process would (Megatron-LM#3672: the global aux loss came out as aux / dp_size;
transformers#48690: the Trainer multiplied the aux by the world size on top).
"""

from __future__ import annotations

import dataclasses

from ..case import Case
from ..errors import InvalidArgument
from .base import Pitfall
from .ddp import Ddp

AUX_OVER_DP = "aux loss averaged over data-parallel ranks (aux / dp size)"
AUX_TIMES_WORLD = "aux loss scaled by the world size twice"


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
