"""A team's own step on a three-dimensional mesh: pipeline x FSDP2 x tensor parallelism (tests/pipeline_mesh.py), on
8 gloo ranks."""

from __future__ import annotations

import pytest

import equivcheck as ec
from equivcheck import Verdict

import pipeline_mesh as pm

MESH = {"pp": 2, "dp": 2, "tp": 2}


def check(step, parallelize=pm.parallelize, reference="full_batch"):
    (outcome,) = ec.check_step("pp_blocks", step, reference, mesh=MESH, parallelize=parallelize,
                               gather=pm.gather).outcomes
    return outcome


def test_pipeline_fsdp2_and_tensor_parallelism_composed_is_equivalent_and_counted_by_dimension():
    """Two stages over pp, each block's Linears split over tp and sharded over dp: the mean of the last stage's losses
    is the step's loss, every gradient and weight read whole from its stage; a step sends and receives over pp, gathers
    and reduce-scatters over dp, all-reduces over tp."""
    outcome = check(pm.step)
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert ec.parse_regime(outcome.regime).world_size == 8
    assert {kind.partition("[")[2] for kind in outcome.result.collectives[0]} == {"pp]", "dp]", "tp]"}


@pytest.mark.parametrize(("step", "parallelize", "reference", "hint"), [
    (pm.step, pm.parallelize_scaled_twice, "full_batch", "on this pipeline by its micro-batch count twice"),
    (pm.step_tp_ranks_differ, pm.parallelize, "full_batch", "the step-0 loss already differs"),
    (pm.step_clipped_per_stage, pm.parallelize, f"full_batch:max_norm={pm.CLIP}", "every gradient differs"),
], ids=["loss scaled by the micro-batch count twice", "a TP group fed different micro-batches",
        "clipping by each stage's own norm"])
def test_each_three_dimensional_pitfall_is_caught(step, parallelize, reference, hint):
    outcome = check(step, parallelize, reference)
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 1000, outcome.describe()
    assert hint in outcome.describe()


def test_clipping_by_the_whole_models_norm_across_stages_is_equivalent():
    outcome = check(pm.step_clipped, reference=f"full_batch:max_norm={pm.CLIP}")
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


def test_a_mesh_names_its_dimensions_among_those_it_knows():
    with pytest.raises(ec.InvalidArgument, match=r"among 'pp', 'dp', 'ep', 'cp', 'tp'"):
        ec.check_step("pp_blocks", pm.step, mesh={"pipeline": 2}, parallelize=pm.parallelize)


def test_the_built_in_three_dimensional_mesh_is_equivalent_and_its_pitfalls_are_caught():
    """pp_fsdp_tp on 8 ranks: the case's blocks a stage each, the derived plan over tp, FSDP2 over dp. The faithful
    share left with scale_grads=True (1/K of every gradient) and a TP group's ranks fed differently shuffled shards
    are caught."""
    faithful, twice, differ, two_d = ec.check("tp_blocks", [
        "pp_fsdp_tp:pp=2,dp=2,tp=2", "pp_fsdp_tp_scaled_twice:pp=2,dp=2,tp=2", "pp_fsdp_tp_ranks_differ:pp=2,dp=2,tp=2",
        "fsdp_tp:dp=2,tp=2"]).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()
    # FSDP2 x TP on the same nested blocks saves a DTensor whose local part is a collective in flight: metered too
    assert two_d.verdict is Verdict.EQUIVALENT, two_d.describe()
    assert {kind.partition("[")[2] for kind in faithful.result.collectives[0]} == {"pp]", "dp]", "tp]"}
    for caught in (twice, differ):
        assert caught.verdict is Verdict.EXPECTED_MISMATCH and caught.comparison.margin > 1000, caught.describe()


def test_a_model_whose_tensor_parallel_pair_would_straddle_two_stages_is_refused():
    with pytest.raises(ec.InvalidArgument, match=r"the tensor-parallel pair 0 \(colwise\) and 2 \(rowwise\) would fall "
                                                 r"in two pipeline stages"):
        ec.check("tp_mlp", ["pp_fsdp_tp:pp=2,dp=1,tp=2"])
