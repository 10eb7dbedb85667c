"""A team's own step and loop on a mesh: its parallelize(model, mesh) applied first, each TP group given its
data-parallel shard, held to one process; the same step with a real TP bug fails; bad mesh arguments are refused."""

import pytest

import equivcheck as ec
from equivcheck import Verdict

import mesh_team


@pytest.mark.parametrize(("mesh", "parallelize"), [
    ({"tp": 2}, mesh_team.tensor_parallel),
    ({"dp": 2, "tp": 2}, mesh_team.fsdp_and_tensor_parallel),
])
def test_a_teams_tensor_parallel_step_is_equivalent_on_its_mesh(mesh, parallelize):
    report = ec.check_step("tp_mlp", mesh_team.train_step, mesh=mesh, parallelize=parallelize)
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert outcome.regime.startswith("mesh_step:")


def test_its_twin_the_loss_divided_by_the_tp_size_is_caught():
    report = ec.check_step("tp_mlp", mesh_team.train_step_divided_by_tp, mesh={"tp": 2},
                           parallelize=mesh_team.tensor_parallel)
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0
    assert outcome.comparison.margin > 1e3


def test_a_teams_loop_on_a_mesh_is_equivalent():
    (outcome,) = ec.check_loop("tp_mlp", mesh_team.train_loop, mesh={"dp": 2, "tp": 2},
                               parallelize=mesh_team.fsdp_and_tensor_parallel).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mesh": {"tp": 2}}, r"parallelize=None is not allowed with mesh=: expected both"),
    ({"mesh": {"pp": 2}, "parallelize": mesh_team.tensor_parallel},
     r"mesh=\{'pp': 2\} is not allowed: expected a dict of dimension sizes by name, among 'dp', 'tp'"),
    ({"mesh": {"tp": 2}, "parallelize": mesh_team.tensor_parallel, "pipeline": True},
     r"pipeline=True is not allowed with mesh=: expected pipeline left out"),
    ({"mesh": {"tp": 2}, "parallelize": mesh_team.tensor_parallel, "world_size": 4},
     r"world_size=4 is not allowed: expected 2 \(the mesh's ranks\), or left out"),
    ({"mesh": {"tp": 0}, "parallelize": mesh_team.tensor_parallel}, r"tp=0 is not allowed"),
])
def test_mesh_arguments_that_cannot_work_are_refused_naming_them(kwargs, message):
    with pytest.raises(ec.InvalidArgument, match=message):
        ec.check_step("tp_mlp", mesh_team.train_step, **kwargs)


def test_a_parallelize_that_returns_no_model_is_a_usage_error_naming_it():
    with pytest.raises(ec.InvalidArgument, match=r"parallelize 'mesh_team:returns_nothing' returned a NoneType: "
                                                 r"expected the model"):
        ec.check_step("tp_mlp", mesh_team.train_step, mesh={"tp": 2}, parallelize=mesh_team.returns_nothing)

