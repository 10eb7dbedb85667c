"""Tensor parallelism: plans given or derived, TP on one mesh dimension and FSDP2 x TP on a dp x tp mesh held to one
process, and the tensor-parallel pitfalls caught beside their faithful twins."""

import dataclasses

import pytest
import torch
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.diff import ProblemKind, kind_of
from equivcheck.regimes.tensor import derived_plan, plan_for


def test_the_common_shape_derives_colwise_then_rowwise():
    assert derived_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 2))) == {
        "0": "colwise", "3": "rowwise"}
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), nn.LayerNorm(4),
                           nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)))
    assert derived_plan(nested) == {"0.0": "colwise", "0.2": "rowwise", "2.0": "colwise", "2.2": "rowwise"}
    # A module with parameters between two Linears breaks the pair: a norm is no activation.
    assert derived_plan(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))) == {}


def test_attention_projections_derive_heads_local_per_rank():
    """Llama's, torchtitan's and BERT's names: q, k and v colwise with the rank's heads kept local, the output rowwise;
    the model's head count is what one rank holds once the plan is applied."""
    from equivcheck.regimes.tensor import localize_heads
    from equivcheck.strategies import SplitAttention

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = SplitAttention(8, 4, bias=True)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8) for _ in range(4))
            self.n_heads = 2

    plan = derived_plan(Block())
    assert plan == {"attention.q_proj": "colwise_local", "attention.k_proj": "colwise_local",
                    "attention.v_proj": "colwise_local", "attention.o_proj": "rowwise", "wq": "colwise_local",
                    "wk": "colwise_local", "wv": "colwise_local", "wo": "rowwise"}
    block = Block()
    localize_heads(block, plan, 2)
    assert (block.attention.n_heads, block.n_heads) == (2, 1)


def test_attention_blocks_under_tp_and_fsdp_tp_reproduce_one_process():
    """A causal attention LM, 4 heads (2 per rank) and its MLP sharded by the derived plan, AdamW in float64; a head
    count that does not halve is skipped saying so."""
    from tensor_cases import ODD_HEADS, SPLIT_ATTENTION

    report = ec.check(SPLIT_ATTENTION, ["tp:world_size=2", "fsdp_tp:dp=2,tp=2"])
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * 2, [o.describe() for o in report.outcomes]
    (odd,) = ec.check_all([ODD_HEADS, SPLIT_ATTENTION], ["tp:world_size=2"]).outcomes[:1]
    assert odd.verdict is Verdict.SKIPPED and "an attention module has n_heads=3, which do not divide over " \
        "world_size=2" in odd.reason, odd.describe()


def test_a_plan_torch_cannot_run_is_an_error_quoting_torch_and_naming_the_way_out():
    from tensor_cases import GLOBAL_HEADS

    (outcome,) = ec.check(GLOBAL_HEADS, ["tp:world_size=2"]).outcomes
    assert outcome.verdict is Verdict.ERROR, outcome.describe()
    assert "got mixed torch.Tensor and DTensor" in outcome.reason and "'colwise_local' for attention's query, key " \
        "and value projections" in outcome.reason, outcome.reason


def test_a_plan_that_cannot_run_names_what_does_not_fit():
    case = ec.get_case("tp_mlp")
    model = case.model()
    with pytest.raises(ec.InvalidArgument, match=r"0 \(colwise\) has 16 output features, which do not divide over "
                                                 r"world_size=3"):
        plan_for(case, model, 3)
    planned = dataclasses.replace(case, name="tp_planned", tp_plan={"0": "colwise", "[2-9]": "rowwise"})
    assert plan_for(planned, model, 2) == {"0": "colwise", "2": "rowwise"}
    missing = dataclasses.replace(case, name="tp_misplanned", tp_plan={"head": "rowwise"})
    with pytest.raises(ec.InvalidArgument, match=r"'head' names no module of its model; its modules: 0, 1, 2"):
        plan_for(missing, model, 2)


@pytest.mark.parametrize("plan", [{"0": "columnwise"}, {0: "colwise"}, ["0", "colwise"]])
def test_a_tp_plan_of_unknown_styles_is_refused_naming_them(plan):
    with pytest.raises(ec.InvalidArgument, match=r"tp_plan=.* is not allowed: expected a mapping of module names "
                                                 r"\(or patterns\) to 'colwise', 'colwise_local', 'rowwise', 'sequence'"):
        dataclasses.replace(ec.get_case("mlp"), name="badly_planned", tp_plan=plan)


def test_a_case_with_no_plan_is_skipped_under_tp_saying_so():
    report = ec.check_all(["tp_mlp", "cnn"], ["tp:world_size=2"])
    by_case = {o.case: o for o in report.outcomes}
    assert by_case["tp_mlp"].verdict is Verdict.EQUIVALENT
    assert by_case["cnn"].verdict is Verdict.SKIPPED
    assert "case 'cnn' has no tensor-parallel plan" in by_case["cnn"].reason and "tp_plan=" in by_case["cnn"].reason


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tp_and_fsdp_tp_reproduce_one_process_and_each_pitfall_is_caught(dtype):
    """The same check, in float64 and float32: faithful TP on 2 ranks and FSDP2 x TP on a 2 x 2 mesh match, and each
    pitfall (different batches per TP rank, the loss scaled by the TP size, the loss scaled by every rank of the mesh)
    is a mismatch far beyond the tolerance."""
    report = ec.check("tp_mlp", dtype=dtype)
    verdicts = {o.regime: o for o in report.outcomes}
    for faithful in ("tp:world_size=2", "fsdp_tp:dp=2,tp=2"):
        assert verdicts[faithful].verdict is Verdict.EQUIVALENT, verdicts[faithful].describe()
    for pitfall in ("tp_different_batches:world_size=2", "tp_loss_scaled:world_size=2",
                    "fsdp_tp_world_scaled:dp=2,tp=2"):
        outcome = verdicts[pitfall]
        assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 1e3, outcome.describe()
    report.assert_equivalent()


def test_the_same_pitfalls_read_as_mismatches_where_nothing_is_declared():
    """Without the case's expect_mismatch, each pitfall is a MISMATCH: the check fails on a real TP bug."""
    from tensor_cases import UNDECLARED

    report = ec.check(UNDECLARED, ["tp_loss_scaled:world_size=2", "tp_different_batches:world_size=2"])
    assert [o.verdict for o in report.outcomes] == [Verdict.MISMATCH, Verdict.MISMATCH]
    with pytest.raises(ec.NotEquivalent):
        report.assert_equivalent()


def test_clipping_by_local_shards_is_caught_and_its_replicas_drift_apart():
    """The global clip (the case's clip_grad_norm_ over DTensors) matches; each rank clipping by its own shards'
    norm does not, and the bias it replicates ends different on the two ranks: the rank drift is reported too."""
    report = ec.check("tp_mlp_clipped")
    _, faithful, local = report.outcomes  # full_batch against itself, then the two TP regimes
    assert faithful.verdict is Verdict.EQUIVALENT
    assert local.verdict is Verdict.EXPECTED_MISMATCH and local.comparison.margin > 100
    (drift,) = [problem for problem in local.comparison.problems if kind_of(problem) is ProblemKind.RANK_DRIFT]
    assert "(at '2.bias', rank 1 against rank 0)" in drift  # the replicated bias, scaled by each rank's own norm


def test_fsdp_tp_spells_its_mesh_and_derives_its_world_size():
    regime = ec.parse_regime("fsdp_tp:dp=2,tp=2")
    assert regime.world_size == 4 and str(regime) == "fsdp_tp:dp=2,tp=2"
    assert ec.parse_regime("fsdp_tp:world_size=4,dp=2,tp=2") == regime
    with pytest.raises(ec.InvalidArgument, match=r"world_size=3 is not allowed: expected dp \* tp = 4"):
        ec.parse_regime("fsdp_tp:world_size=3,dp=2,tp=2")
