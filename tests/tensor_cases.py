"""A case for the tensor-parallel tests that ranks import by name: tp_mlp with no pitfall declared, so that each
tensor-parallel pitfall reads as the mismatch it is."""

import dataclasses

import equivcheck as ec

UNDECLARED = ec.register_case(dataclasses.replace(ec.get_case("tp_mlp"), name="tp_mlp_undeclared", expect_mismatch={}))


# A planted change for the collectives' count (tests/test_tensor_collectives.py): TP whose step, after its backward,
# gathers the rowwise Linear's weight whole once more (a redundant DTensor redistribution, as a team's debugging code
# left in a step would): one more all-gather over tp per step, and the gradients and weights unchanged.
from equivcheck.regimes import register_regime  # noqa: E402
from equivcheck.regimes.tensor import TensorParallel  # noqa: E402


@register_regime
@dataclasses.dataclass(frozen=True)
class TensorParallelExtraGather(TensorParallel):
    name = "tp_extra_gather"
    summary = "TP that gathers the rowwise Linear's weight whole once per step besides: one more all-gather over tp"

    def clip(self, optimizer, objective) -> None:
        from torch.distributed.tensor import Replicate

        weight = optimizer.param_groups[0]["params"][2]  # the rowwise Linear's weight, sharded by its input features
        weight.detach().redistribute(placements=[Replicate()])
        super().clip(optimizer, objective)
