"""A team's own DDP comm hook under ec.check_step: registered in its wrap (before equivcheck's counter) or in its
step (after it), the team's hook runs inside the counting one and is counted as equivcheck's own default is,
instead of torch refusing a second hook ("register_comm_hook ... can only be called once"). The hooks, wraps and
steps live in tests/team_comm_hooks.py: the ranks import them by name."""

import pytest
import team_comm_hooks as hooks

import equivcheck as ec
from equivcheck.precision import resolve_precision
from equivcheck.registry import get_case

BUCKET = 8 * 103  # the 6-10-3 MLP's 103 float64 gradients: one bucket, as DDP hands it to the hook
FP16_BUCKET = 2 * 103  # what fp16_compress_hook all-reduces: the same elements in float16


def fp16_bound() -> ec.Tolerance:
    """The bound the ddp_hook regime judges torch's fp16_compress_hook at over 2 ranks (float64's tolerance plus 3
    roundings of 2^-11): a team's own fp16 hook is judged at the same one, passed as rtol and atol."""
    return ec.DdpHook(world_size=2, hook="fp16").tolerance_for(get_case(hooks.CASE), resolve_precision(None),
                                                               ec.Tolerance(1e-7, 1e-7))


def check(step, wrap=None, **options):
    (outcome,) = ec.check_step(hooks.CASE, step, world_size=2, wrap=wrap, **options).outcomes
    return outcome


def test_a_teams_fp16_hook_registered_in_its_wrap_is_counted_not_refused():
    """Failed before the counter wrapped team hooks: rank 0 raised torch's 'can only be called once'."""
    bound = fp16_bound()
    outcome = check(hooks.train_step, hooks.fp16_compressed, rtol=bound.rtol, atol=bound.atol)
    assert outcome.verdict is ec.Verdict.EQUIVALENT, outcome.describe()
    assert not outcome.comparison.problems  # no communication finding: one sync per step, as DDP's own
    assert outcome.result.syncs == (1, 1, 1) and outcome.result.sync_wrappers == 1
    assert outcome.result.sync_bytes == (BUCKET,) * 3  # the bucket as DDP hands it over, before compression
    # the team's hook really ran: what went over the wire is the bucket in float16
    assert outcome.result.collectives == ({"all_reduce": (1, FP16_BUCKET)},) * 3


def test_the_teams_fp16_hook_fails_float64s_own_tolerance():
    """The twin: compared at float64's tolerance (no bound given) the compression shows."""
    outcome = check(hooks.train_step, hooks.fp16_compressed)
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.comparison.margin > 100, outcome.describe()
    assert outcome.result.syncs == (1, 1, 1) and not outcome.comparison.problems


def test_a_teams_plain_allreduce_hook_is_equivalent_and_counted_as_ddps_own():
    outcome = check(hooks.train_step, hooks.plain_allreduce)
    assert outcome.verdict is ec.Verdict.EQUIVALENT and outcome.comparison.margin < 1e-4, outcome.describe()
    assert outcome.result.syncs == (1, 1, 1) and outcome.result.sync_bytes == (BUCKET,) * 3
    assert outcome.result.collectives == ({"all_reduce": (1, BUCKET)},) * 3


def test_a_teams_hook_on_a_static_graph_with_small_buckets_buckets_as_ddp_does_without_one():
    """The reducer is built again around the team's hook with the wrapper's own options: static_graph and buckets of
    104 bytes give the same all-reduces as equivcheck's ddp regime with those options and no hook (the gradients in
    one bucket until DDP rebuilds its buckets by the cap, then in 2), and one sync per step."""
    outcome = check(hooks.train_step, hooks.plain_allreduce_static_small_buckets)
    assert outcome.verdict is ec.Verdict.EQUIVALENT and outcome.comparison.margin < 1e-4, outcome.describe()
    assert outcome.result.syncs == (1, 1, 1) and outcome.result.sync_bytes == (BUCKET,) * 3
    (ddps,) = ec.check(hooks.CASE, ["ddp:world_size=2,bucket_cap_mb=0.0001,static_graph=1"],
                       measure_memory=False).outcomes
    assert outcome.result.collectives == ddps.result.collectives
    assert [step["all_reduce"] for step in outcome.result.collectives][-1] == (2, BUCKET)


def test_a_hook_the_step_registers_after_the_counter_is_counted():
    bound = fp16_bound()
    outcome = check(hooks.train_step_registering_fp16, rtol=bound.rtol, atol=bound.atol)
    assert outcome.verdict is ec.Verdict.EQUIVALENT, outcome.describe()
    assert outcome.result.syncs == (1, 1, 1)
    assert outcome.result.collectives == ({"all_reduce": (1, FP16_BUCKET)},) * 3


def test_a_hook_all_reducing_every_bucket_twice_is_a_communication_finding():
    """The numbers stay right (the second all-reduce of the average, halved, is the average again): counted as two
    syncs a step, which a faithful step makes once."""
    outcome = check(hooks.train_step, hooks.allreduce_twice)
    assert outcome.verdict is ec.Verdict.COMMUNICATION and not outcome.comparison.mismatches, outcome.describe()
    assert outcome.result.syncs == (2, 2, 2) and outcome.result.sync_bytes == (2 * BUCKET,) * 3
    assert outcome.result.collectives == ({"all_reduce": (2, 2 * BUCKET)},) * 3
    assert outcome.comparison.problems == (
        f"communication: step 0 all-reduced gradients 2 time(s) ({2 * BUCKET} bytes per rank); a faithful step "
        "does it 1 time(s)",)


def test_a_hook_all_reducing_twice_that_changes_the_numbers_is_a_mismatch_with_the_count_beside_it():
    outcome = check(hooks.train_step, hooks.allreduce_twice_summing)
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.comparison.margin > 100, outcome.describe()
    assert outcome.result.syncs == (2, 2, 2)
    assert outcome.comparison.problems[0].startswith("communication: step 0 all-reduced gradients 2 time(s)")


def test_a_second_hook_on_one_wrapper_is_refused_in_torchs_words():
    outcome = check(hooks.train_step_registering_twice, hooks.plain_allreduce)
    assert outcome.verdict is ec.Verdict.ERROR
    assert "register_comm_hook or register_builtin_comm_hook can only be called once" in outcome.reason


def test_a_builtin_hook_is_refused_naming_the_python_hook_to_register():
    with pytest.raises(ec.InvalidArgument, match="built-in comm hook BuiltinCommHookType.ALLREDUCE .* "
                                                 "default_hooks.allreduce_hook"):
        ec.check_step(hooks.CASE, hooks.train_step, world_size=2, wrap=hooks.builtin_allreduce)
