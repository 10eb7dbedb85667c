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


def test_a_teams_collectives_are_counted_by_dimension_and_held_to_what_it_declares():
    """The step on a 2 x 2 mesh makes what FSDP2 over dp and the plan over tp make (counted as the fsdp_tp regime's);
    declared, it passes; the same step gathering a weight once more is a communication verdict naming the kind."""
    declared = {"all_reduce[tp]": 1, "all_gather[dp]": 1, "reduce_scatter[dp]": 1}  # the root only: kept for the backward
    (counted,) = ec.check_step("tp_mlp", mesh_team.train_step, mesh={"dp": 2, "tp": 2},
                               parallelize=mesh_team.fsdp_and_tensor_parallel).outcomes
    assert counted.verdict is Verdict.EQUIVALENT, counted.describe()
    assert [{kind: calls for kind, (calls, _) in step.items()} for step in counted.result.collectives] == [declared] * 3
    (held,) = ec.check_step("tp_mlp", mesh_team.train_step, mesh={"dp": 2, "tp": 2},
                            parallelize=mesh_team.fsdp_and_tensor_parallel, collectives=declared).outcomes
    assert held.verdict is Verdict.EQUIVALENT and held.regime.endswith(
        ",collectives=all_gather[dp]*1+all_reduce[tp]*1+reduce_scatter[dp]*1"), held.describe()
    (extra,) = ec.check_step("tp_mlp", mesh_team.train_step_gathering_again, mesh={"tp": 2},
                             parallelize=mesh_team.tensor_parallel, collectives={"all_reduce[tp]": 1}).outcomes
    assert extra.verdict is Verdict.COMMUNICATION, extra.describe()
    assert ("communication: step 0 made all_gather[tp] 1 time (192 bytes per rank), all_reduce[tp] 1 time "
            "(288 bytes per rank); the spec declares all_reduce[tp] 1 time") in extra.comparison.problems


def test_a_teams_step_counts_per_call_what_it_communicates_after_its_optimizer_step():
    """The loss a team logs, all-reduced after optimizer.step(): counted with the call that made it, so every call
    makes as many and a declaration holds (per optimizer step they were 1, 2, 2 plus one after the last)."""
    (logged,) = ec.check_step("tp_mlp", mesh_team.train_step_logging_the_mean_loss, mesh={"tp": 2},
                              parallelize=mesh_team.tensor_parallel, collectives={"all_reduce[tp]": 2}).outcomes
    assert logged.verdict is Verdict.EQUIVALENT, logged.describe()
    assert [{kind: calls for kind, (calls, _) in step.items()} for step in logged.result.collectives] == \
        [{"all_reduce[tp]": 2}] * 3


def test_collectives_on_a_teams_own_sub_groups_are_counted_by_their_ranks_and_can_be_declared():
    declared = {"all_gather[dp]": 1, "reduce_scatter[dp]": 1, "all_reduce[ranks_0_1]": 1}
    (held,) = ec.check_step("tp_mlp", mesh_team.train_step_syncing_a_pair, mesh={"dp": 4},
                            parallelize=mesh_team.data_parallel_in_pairs, collectives=declared).outcomes
    assert held.verdict is Verdict.EQUIVALENT, held.describe()
    (short,) = ec.check_step("tp_mlp", mesh_team.train_step_syncing_a_pair, mesh={"dp": 4},
                             parallelize=mesh_team.data_parallel_in_pairs,
                             collectives={"all_gather[dp]": 1, "reduce_scatter[dp]": 1}).outcomes
    assert short.verdict is Verdict.COMMUNICATION and "all_reduce[ranks_0_1] 1 time" in short.comparison.problems[0]


def test_a_declaration_naming_a_dimension_the_mesh_lacks_is_refused_before_anything_runs():
    with pytest.raises(ec.InvalidArgument, match=r"'all_to_all\[ep\]' names 'ep', expected a dimension of this mesh "
                                                 r"\('dp', 'tp'\), 'world', or a sub-group by its ranks \('ranks_0_1'\)"):
        ec.check_step("tp_mlp", mesh_team.train_step, mesh={"dp": 2}, parallelize=mesh_team.sequence_over_cp,
                      collectives={"all_to_all[ep]": 2})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mesh": {"tp": 2}}, r"parallelize=None is not allowed with mesh=: expected both"),
    ({"mesh": {"sp": 2}, "parallelize": mesh_team.tensor_parallel},
     r"mesh=\{'sp': 2\} is not allowed: expected a dict of dimension sizes by name, among 'pp', 'dp', 'ep', 'cp', "
     r"'tp'"),
    ({"mesh": {"tp": 2}, "parallelize": mesh_team.tensor_parallel, "pipeline": True},
     r"pipeline=True is not allowed with mesh=: expected pipeline left out"),
    ({"mesh": {"tp": 2}, "parallelize": mesh_team.tensor_parallel, "world_size": 4},
     r"world_size=4 is not allowed: expected 2 \(the mesh's ranks\), or left out"),
    ({"mesh": {"tp": 0}, "parallelize": mesh_team.tensor_parallel}, r"tp=0 is not allowed"),
    ({"world_size": 2, "collectives": {"all_reduce": 1}},
     r"collectives=\{'all_reduce': 1\} is not allowed without mesh=: expected mesh= and parallelize="),
    ({"mesh": {"tp": 2}, "parallelize": mesh_team.tensor_parallel, "collectives": {"all reduce": 1}},
     r"collectives=\{'all reduce': 1\} is not allowed: expected a dict of collective kinds to calls per step"),
])
def test_mesh_arguments_that_cannot_work_are_refused_naming_them(kwargs, message):
    with pytest.raises(ec.InvalidArgument, match=message):
        ec.check_step("tp_mlp", mesh_team.train_step, **kwargs)


def test_a_parallelize_that_returns_no_model_is_a_usage_error_naming_it():
    with pytest.raises(ec.InvalidArgument, match=r"parallelize 'mesh_team:returns_nothing' returned a NoneType: "
                                                 r"expected the model"):
        ec.check_step("tp_mlp", mesh_team.train_step, mesh={"tp": 2}, parallelize=mesh_team.returns_nothing)



def test_a_context_parallel_dimension_hands_each_cp_rank_its_data_parallel_groups_shard():
    """A team's own sequence split over a cp dimension (per-token sp_block: its tokens' loss, gradients summed over
    cp) matches one process on cp 2 and on dp 2 x cp 2; with the sum over cp left out, the same check fails and the
    replicas drift."""
    for mesh in ({"cp": 2}, {"dp": 2, "cp": 2}):
        (outcome,) = ec.check_step("sp_block", mesh_team.train_step_over_cp, mesh=mesh,
                                   parallelize=mesh_team.sequence_over_cp).outcomes
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    (unreduced,) = ec.check_step("sp_block", mesh_team.train_step_over_cp_unreduced, mesh={"cp": 2},
                                 parallelize=mesh_team.sequence_over_cp).outcomes
    assert unreduced.verdict is Verdict.MISMATCH and "ranks disagree" in unreduced.describe(), unreduced.describe()


def test_a_teams_own_layers_on_plain_local_shards_are_read_back_through_its_gather():
    """Megatron-style layers with plain local shards and collectives by hand: with the team's gather the check reads
    the whole weights and gradients and passes, its one all-reduce over tp counted and held to the declaration; the
    same layers with the loss divided by the TP size fail; without the gather the shards cannot be compared."""
    kwargs = {"mesh": {"tp": 2}, "parallelize": mesh_team.megatron_shards}
    (gathered,) = ec.check_step("tp_mlp", mesh_team.train_step, **kwargs, gather=mesh_team.gather_shards,
                                collectives={"all_reduce[tp]": 1}).outcomes
    assert gathered.verdict is Verdict.EQUIVALENT, gathered.describe()
    (buggy,) = ec.check_step("tp_mlp", mesh_team.train_step_divided_by_tp, **kwargs,
                             gather=mesh_team.gather_shards).outcomes
    assert buggy.verdict is Verdict.MISMATCH and buggy.comparison.margin > 1e3, buggy.describe()
    (ungathered,) = ec.check_step("tp_mlp", mesh_team.train_step, **kwargs).outcomes
    assert ungathered.verdict is Verdict.MISMATCH and "weight of '0.weight': candidate has (8, 6), reference (16, 6)" \
        in ungathered.comparison.problems, ungathered.describe()
    (new_layers,) = ec.check_step("tp_mlp", mesh_team.train_step, mesh={"tp": 2},
                                  parallelize=mesh_team.megatron_new_layers, gather=mesh_team.gather_shards).outcomes
    assert new_layers.verdict is Verdict.EQUIVALENT, new_layers.describe()  # optimised, recorded and read back
    (held_by_one,) = ec.check_step("tp_mlp", mesh_team.train_step, mesh={"tp": 2},
                                   parallelize=mesh_team.megatron_bias_on_first_rank,
                                   gather=mesh_team.gather_shards_and_the_bias).outcomes
    assert held_by_one.verdict is Verdict.EQUIVALENT, held_by_one.describe()  # asked for every name on every rank
    with pytest.raises(ec.InvalidArgument, match=r"gather=<function gather_shards .*> is not allowed without mesh=: "
                                                 r"expected mesh= and parallelize="):
        ec.check_step("tp_mlp", mesh_team.train_step, world_size=2, gather=mesh_team.gather_shards)


def test_a_last_batch_of_one_sample_reaches_every_rank_of_a_tp_group_and_is_refused_over_two_dp_groups():
    """A global batch is cut over the mesh's data-parallel groups, not its ranks: one sample is enough for a TP group
    of two; over dp=2 one group would get none, which is refused naming dp."""
    (tp,) = ec.check_step(mesh_team.SHORT_TAIL, mesh_team.train_step, mesh={"tp": 2},
                          parallelize=mesh_team.tensor_parallel).outcomes
    assert tp.verdict is Verdict.EQUIVALENT, tp.describe()
    with pytest.raises(ec.InvalidArgument, match=r"a global batch of 1 sample\(s\) \(an epoch's smaller last batch\) is "
                                                 r"not allowed over dp=2"):
        ec.check_step(mesh_team.SHORT_TAIL, mesh_team.train_step, mesh={"dp": 2, "tp": 2},
                      parallelize=mesh_team.fsdp_and_tensor_parallel)


def test_a_teams_row_parallel_layer_adding_its_bias_on_every_rank_is_located_in_that_layer():
    """The team's RowParallelLinear module (made by its parallelize, not the case's): its output whole (its own
    all-reduce made it), its input a column shard joined from its ranks; with the bias added before the all-reduce
    (counted twice) the difference is located in it, its inputs matching."""
    kwargs = {"mesh": {"tp": 2}, "gather": mesh_team.gather_shards}
    (faithful,) = ec.check_step("tp_mlp", mesh_team.train_step, parallelize=mesh_team.row_parallel_layers,
                                **kwargs).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()
    (twice,) = ec.check_step("tp_mlp", mesh_team.train_step, parallelize=mesh_team.row_parallel_bias_on_every_rank,
                             **kwargs, locate=True).outcomes
    location = twice.location
    assert (location.step, location.phase, location.module) == (0, "forward", "2"), twice.describe()
    assert location.tensor == "the output of `2`" and location.matched == "its inputs match"
