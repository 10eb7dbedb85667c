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


# A causal attention LM whose attention has projections of its own (q_proj, k_proj, v_proj, o_proj): the derived plan
# shards them by heads (4 heads, 2 on each rank), beside its MLP; and one with 3 heads, which cannot be halved.
from equivcheck.strategies import CaseSpec  # noqa: E402

ATTENTION = CaseSpec(widths=(8, 11), activation="gelu", dtype="float64", batch_size=6, steps=2, loss="cross_entropy",
                     optimizer="adamw", lr=0.01, heads=4, block=5, attention_bias=True, split_attention=True)
SPLIT_ATTENTION = ec.register_case(ATTENTION.build())
ODD_HEADS = ec.register_case(dataclasses.replace(ATTENTION, widths=(12, 11), heads=3).build())

# The same LM with its attention projections plain 'colwise' (DTensor outputs, heads global): torch's CPU attention
# kernel cannot take them.
GLOBAL_HEADS = ec.register_case(dataclasses.replace(
    ATTENTION.build(), name="attention_heads_global",
    tp_plan={"trunk.attn.[qkv]_proj": "colwise", "trunk.attn.o_proj": "rowwise"}))
