"""A team's own expert parallelism through check_step: ``ep`` as a mesh dimension (issue 48's first part), tokens
exchanged by all_to_all_single over gloo, counted by dimension."""

from __future__ import annotations

import pytest

import equivcheck as ec
from equivcheck import Verdict

import expert_parallel as ep
import expert_parallel_local as local


@pytest.mark.parametrize("mesh", [{"ep": 2}, {"dp": 2, "ep": 2}], ids=["ep 2", "dp 2 x ep 2"])
def test_a_teams_expert_parallel_step_is_equivalent_and_its_all_to_all_counted_over_ep(mesh):
    """Each rank of ep routes tokens of its own (the batch is cut over dp x ep) to the rank of their expert and back:
    every expert's gradient, whole on its rank, matches one process's, and the exchange is counted on ep."""
    (outcome,) = ec.check_step("ep_experts", ep.step, mesh=mesh, parallelize=ep.parallelize, gather=ep.gather).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert all(step["all_to_all[ep]"][0] > 0 for step in outcome.result.collectives)


@pytest.mark.parametrize("step", [ep.step_experts_averaged, ep.step_dense_unreduced],
                         ids=["experts averaged over ep", "router and head never all-reduced"])
def test_a_teams_expert_parallel_bugs_are_caught(step):
    (outcome,) = ec.check_step("ep_experts", step, mesh={"ep": 2}, parallelize=ep.parallelize,
                               gather=ep.gather).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 1000, outcome.describe()


def test_ep_is_a_dimension_of_a_teams_mesh_and_its_ranks_hold_shards_of_their_own():
    regime = ec.parse_regime("mesh_step:fn=expert_parallel:step,parallelizer=expert_parallel:parallelize,dp=2,ep=2")
    assert regime.world_size == 4 and regime.sizes == {"dp": 2, "ep": 2, "tp": 1}
    assert regime.shards == ("dp * ep", 4)


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"ep": 2}, {"dp": 2, "ep": 2}], ids=["dp 2", "ep 2", "dp 2 x ep 2"])
def test_experts_numbered_locally_on_each_rank_are_read_back_by_the_teams_name_map(mesh):
    """Megatron's layout: each rank's experts a ModuleList of its own, numbered from 0; parallelize returns (model,
    names) and every expert's weight and gradient is read back under the single-process name, from its rank."""
    (outcome,) = ec.check_step(local.CASE, local.step, mesh=mesh, parallelize=local.parallelize).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert set(outcome.result.weights) == {name for name, _ in local.RoutedMLP().named_parameters()}


@pytest.mark.parametrize(("step", "mesh"), [(local.step_experts_averaged, {"ep": 2}),
                                            (local.step_experts_averaged, {"dp": 2, "ep": 2}),
                                            (local.step_experts_not_summed_over_dp, {"dp": 2}),
                                            (local.step_experts_not_summed_over_dp, {"dp": 2, "ep": 2})],
                         ids=["averaged over ep 2", "averaged over ep, dp 2 x ep 2", "not summed over dp 2",
                              "not summed over dp, dp 2 x ep 2"])
def test_a_local_numbering_teams_bugs_are_caught(step, mesh):
    (outcome,) = ec.check_step(local.CASE, step, mesh=mesh, parallelize=local.parallelize).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 1000, outcome.describe()
    assert any(m.kind == "grad" and m.name.startswith("experts.") for m in outcome.comparison.mismatches)
