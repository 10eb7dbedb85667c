"""Tensor with sequence parallelism (Megatron-style SP): tp_sp held to one process, and the reported bug, a
sequence-parallel norm whose gradients are never all-reduced over the TP group, caught with the rank drift it leaves;
Megatron's own fix (the norms' gradients all-reduced after the backward) passes, and fails once that all-reduce is
gone. Ranks import this module by name: it registers the case with nothing declared and the fixed regime."""

import dataclasses

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.diff import ProblemKind, kind_of
from equivcheck.regimes import register_regime
from equivcheck.regimes.sequence import TensorSequenceParallelNormUnreduced

PITFALL = "tp_sp_norm_unreduced:world_size=2"


@register_regime
@dataclasses.dataclass(frozen=True)
class MegatronNormAllReduced(TensorSequenceParallelNormUnreduced):
    """Megatron's way done right: the norm's weight and bias plain tensors on each rank's sequence shard, their
    gradients all-reduced over the TP group after the backward (finalize_model_grads' _allreduce_layernorm_grads)."""

    name = "tp_sp_megatron_norm"
    summary = "Megatron-style sequence-parallel norms with their gradients all-reduced over the TP group"
    pitfall = None
    allreduce_norm_grads = True


UNDECLARED = ec.register_case(dataclasses.replace(ec.get_case("sp_block"), name="sp_block_undeclared",
                                                  expect_mismatch={}))


def _problems(outcome):
    return {kind_of(problem) for problem in outcome.comparison.problems}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tp_sp_reproduces_one_process_and_the_unreduced_norm_is_caught(dtype):
    """On 2 and 4 ranks (the sequence of 8 divides over both) tp_sp matches full batch; the norm whose gradients are
    never all-reduced is a mismatch far beyond tolerance at the norm's weight and bias, whose replicas drift apart."""
    report = ec.check("sp_block", ["full_batch", "tp_sp:world_size=2", "tp_sp:world_size=4", PITFALL], dtype=dtype)
    verdicts = {o.regime: o for o in report.outcomes}
    for faithful in ("tp_sp:world_size=2", "tp_sp:world_size=4"):
        outcome = verdicts[faithful]
        assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 0.1, outcome.describe()
        assert ProblemKind.RANK_DRIFT not in _problems(outcome)
    pitfall = verdicts[PITFALL]
    assert pitfall.verdict is Verdict.EXPECTED_MISMATCH and pitfall.comparison.margin > 1e3, pitfall.describe()
    assert ProblemKind.RANK_DRIFT in _problems(pitfall)
    described = pitfall.describe()
    assert "grad of 'norm.weight' mismatched from step 0" in described
    assert "grad of 'norm.bias' mismatched from step 0" in described
    assert "ranks disagree" in described and "'norm." in described.split("ranks disagree")[1].splitlines()[0]
    report.assert_equivalent()


def test_the_unreduced_norm_reads_as_a_mismatch_where_nothing_is_declared():
    report = ec.check(UNDECLARED, [PITFALL])
    [outcome] = report.outcomes
    assert outcome.verdict is Verdict.MISMATCH and ProblemKind.RANK_DRIFT in _problems(outcome)
    with pytest.raises(ec.NotEquivalent):
        report.assert_equivalent()


def test_megatrons_fix_passes_and_fails_once_its_all_reduce_is_gone():
    """The same plain-weight norm on sequence shards, its gradients all-reduced over the TP group: equivalent, no
    drift. The pitfall is that regime with the all-reduce removed (allreduce_norm_grads = False): a mismatch."""
    assert MegatronNormAllReduced.allreduce_norm_grads and not TensorSequenceParallelNormUnreduced.allreduce_norm_grads
    report = ec.check(UNDECLARED, ["tp_sp_megatron_norm:world_size=2", PITFALL])
    fixed, unreduced = report.outcomes
    assert fixed.verdict is Verdict.EQUIVALENT and fixed.comparison.margin < 0.1, fixed.describe()
    assert ProblemKind.RANK_DRIFT not in _problems(fixed)
    assert unreduced.verdict is Verdict.MISMATCH and unreduced.comparison.margin > 1e3


def test_a_case_with_no_sequence_to_shard_is_skipped_under_tp_sp_saying_why():
    report = ec.check_all(["sp_block", "tp_mlp"], ["tp_sp:world_size=2"])
    by_case = {o.case: o for o in report.outcomes}
    assert by_case["sp_block"].verdict is Verdict.EQUIVALENT
    outcome = by_case["tp_mlp"]
    assert outcome.verdict is Verdict.SKIPPED
    assert "case 'tp_mlp' has no sequence-parallel module" in outcome.reason and "tp_plan=" in outcome.reason
    short = dataclasses.replace(ec.get_case("sp_block"), name="sp_block_short",
                                data=lambda: (torch.randn(36, 6, 8), torch.randint(0, 3, (36, 6))))
    with pytest.raises(ec.InvalidArgument, match=r"inputs of shape \(36, 6, 8\) are not allowed: expected \(samples, "
                                                 r"sequence, features\), a sequence \(dim 1\) that divides over 4"):
        ec.parse_regime("tp_sp:world_size=4").validate(short)


def test_the_pitfall_declares_its_bug_and_its_twin():
    regime = ec.parse_regime(PITFALL)
    assert type(regime).pitfall.bug == "sequence-parallel norm gradients not all-reduced over tensor parallelism"
    assert str(type(regime).pitfall.twin_of(regime)) == "tp_sp:world_size=2"


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "dp=1,tp=2", "dp=2,tp=1"])
def test_sequence_parallelism_on_a_dp_x_tp_mesh_reproduces_one_process(mesh):
    """FSDP2 over dp beside TP with SP over tp (torchtitan's 2-D layout): each TP group its dp shard, the sequence cut
    over tp, in float64; the reduce-scatters over dp and the sequence's gathers over tp counted by dimension."""
    (outcome,) = ec.check("sp_block", [f"fsdp_tp_sp:{mesh}"], dtype=torch.float64).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    kinds = set(outcome.result.collectives[0])
    assert ("reduce_scatter[dp]" in kinds) == mesh.startswith("dp=2") and ("all_gather[tp]" in kinds) == \
        mesh.endswith("tp=2"), kinds


def test_a_plan_with_sequence_modules_is_skipped_where_nothing_shards_the_sequence():
    report = ec.check_all(["sp_block", "tp_mlp"], ["tp:world_size=2", "fsdp_tp:dp=2,tp=2"])
    for outcome in (o for o in report.outcomes if o.case == "sp_block"):
        assert outcome.verdict is Verdict.SKIPPED and "expected tp_sp or fsdp_tp_sp for it" in outcome.reason, \
            outcome.describe()
