"""Uneven inputs under DDP: a rank that runs out of data joins (model.join()) and shadows its peers' collectives,
exact against full batch; the same without join hangs and becomes an error within the job timeout, the pool
usable afterwards; join with each rank's own mean is caught by its numbers. Within one step, no_sync
accumulation over different micro-batch counts needs no join, and inside join it crashes a rank."""

import time

import pytest
from hypothesis import find, given, settings

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.runners.ranks import pool as pools
from equivcheck.strategies import regime_specs
from equivcheck.regimes.ddp_join import holders, micro_batches_of, steps_of
from processes import alive

CASE = "ddp_join_uneven_tail"  # mlp: 12 samples per step, 3 steps


@pytest.fixture(scope="module")
def report():
    had_three = ("gloo", 3) in pools._pools
    yield ec.check(CASE, [*ec.regimes_for(ec.get_case(CASE)), "ddp_join:world_size=3,chunks=2",
                          "ddp_uneven_micro_batches:world_size=3,chunks=3"])
    if not had_three:  # no 3-rank pool left warm for later modules (test_faults starts one and interrupts it)
        pools._pools.pop(("gloo", 3)).close()


def test_join_stays_exact_with_uneven_shards_too():
    """11 samples per step: shards of 6 and 5 in the first two steps, all 11 on rank 0 in the last."""
    outcome = ec.check("ddp_uneven_shards", ["ddp_join:world_size=2,chunks=2"]).outcomes[0]
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.describe()


def test_the_dealing_rules():
    assert [steps_of(rank, 3) for rank in range(4)] == [3, 2, 1, 1]
    assert [holders(step, 3, 2) for step in range(3)] == [2, 2, 1]  # the last global batch goes to rank 0 alone
    assert [micro_batches_of(rank, 3) for rank in range(4)] == [3, 2, 1, 1]


@pytest.mark.parametrize("spec", ["ddp_join:world_size=2,chunks=3", "ddp_join:world_size=3,chunks=2"])
def test_join_matches_full_batch_while_a_rank_sits_out_the_last_step(report, spec):
    outcome = report.outcome(CASE, spec)
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.describe()
    result = outcome.result
    assert result.syncs == (1, 1, 1)  # rank 0's gradient all-reduces: one per step, the last one shadowed
    # rank 0 stepped 3 times, the last rank once fewer per rank before it (steps_of): the spread per step is known
    # only where every rank stepped; join broadcast rank 0's weights to the ranks that sat out
    world_size = ec.parse_regime(spec).world_size
    assert len(result.rank_grad_spread) == steps_of(world_size - 1, 3) < 3 and result.rank_spread == 0


def test_join_counts_its_flag_all_reduces_and_the_closing_broadcast(report):
    """Rank 0 of ddp_join:world_size=2,chunks=3 per step: its gradient all-reduce (the last one shadowed by rank 1)
    and, per forward, two one-element all-reduces (Join.notify_join_context and DDP's 'does this backward sync');
    after its last step join's two closing rounds and the broadcast of rank 0's parameters to the joined rank,
    counted in the last step. A flag is a one-element tensor of the default dtype while the case trains (float64)."""
    model = ec.get_case(CASE).model().double()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    flag, forwards = 8, 3
    join = report.outcome(CASE, "ddp_join:world_size=2,chunks=3").result
    every = (1 + 2 * forwards, whole + 2 * forwards * flag)
    assert join.collectives[:2] == ({"all_reduce": every},) * 2
    assert join.collectives[2] == {"all_reduce": (every[0] + 2, every[1] + 2 * flag), "broadcast": (1, whole)}
    assert join.syncs == (1, 1, 1) and join.sync_bytes == (whole,) * 3  # the syncs stay the gradients' alone
    plain = report.outcome(CASE, "ddp_uneven_micro_batches:world_size=2,chunks=3").result  # no join: gradients only
    assert plain.collectives == ({"all_reduce": (1, whole)},) * 3


def test_join_with_each_ranks_own_mean_is_caught_at_the_step_a_rank_sits_out(report):
    outcome = report.outcome(CASE, "ddp_join_rank_mean:world_size=2,chunks=3")
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 100
    # shards of 6 and 6: each rank's mean is right while both train; the last step's gradient comes out halved
    assert {m.first_step for m in outcome.comparison.mismatches if m.kind == "grad"} == {2}


@pytest.mark.parametrize("spec", ["ddp_uneven_micro_batches:world_size=2,chunks=3",
                                  "ddp_uneven_micro_batches:world_size=3,chunks=3"])
def test_different_micro_batch_counts_under_no_sync_need_no_join(report, spec):
    outcome = report.outcome(CASE, spec)
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.describe()
    assert outcome.result.syncs == (1, 1, 1)  # every rank all-reduces once, at its own last micro-batch


def test_ddp_options_reach_join_too():
    """A parameter no training forward uses: under join the joined rank shadows DDP's unused-parameter all-reduce."""
    specs = ["ddp_join:world_size=2,chunks=3,find_unused_parameters=1",
             "ddp_uneven_micro_batches:world_size=2,chunks=3,find_unused_parameters=1"]
    report = ec.check("unused_branch", specs)
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT, Verdict.EQUIVALENT]


def test_without_join_the_hang_is_an_error_within_the_timeout_and_the_pool_recovers():
    pids = pools.pool_for("gloo", 2).pids
    started = time.monotonic()
    (hung,) = ec.check(CASE, ["ddp_uneven_without_join:world_size=2,chunks=3"], timeout=3).outcomes
    assert time.monotonic() - started < 13
    assert hung.verdict is Verdict.ERROR and "rank(s) 0 of 2 made no progress for 3 s" in hung.reason
    assert "rank 0 stack when it timed out" in hung.details and "ddp_join.py" in hung.details
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a rank of the hung pool outlived it"
    after = ec.check("mlp", ["ddp:world_size=2"]).outcomes[0]
    assert after.verdict is Verdict.EQUIVALENT and pools.pool_for("gloo", 2).pids != pids


def test_no_sync_inside_join_with_different_micro_batch_counts_crashes_a_rank():
    """The trap: under join every forward is a collective round, so the ranks synchronise in different rounds."""
    (crashed,) = ec.check(CASE, ["ddp_uneven_micro_batches_join:world_size=2,chunks=3"]).outcomes
    assert crashed.verdict is Verdict.ERROR and "killed by SIGABRT" in crashed.reason, crashed.describe()
    assert ec.check("mlp", ["ddp:world_size=2"]).outcomes[0].verdict is Verdict.EQUIVALENT


def test_the_hang_and_the_crash_are_never_drawn():
    names = set()
    specs = regime_specs(12, pitfalls=True)

    @settings(max_examples=150, derandomize=True, database=None, deadline=None)
    @given(spec=specs)
    def collect(spec):
        names.add(ec.parse_regime(spec).name)

    collect()
    assert not names & {"ddp_uneven_without_join", "ddp_uneven_micro_batches_join"}
    # Drawable, each found by a search: which ones 150 draws meet depends on how many regimes the process registered.
    for name in ("ddp_join", "ddp_join_rank_mean", "ddp_uneven_micro_batches"):
        assert ec.parse_regime(find(specs, lambda spec: ec.parse_regime(spec).name == name,
                                    settings=settings(max_examples=2000, database=None))).name == name
    assert ec.REGIMES["ddp_uneven_without_join"].pitfall and not ec.REGIMES["ddp_join"].pitfall


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ddp_join:world_size=2,chunks=0", "chunks=0 is not allowed: expected an integer >= 1"),
        ("ddp_join:world_size=2,chunks=x", "Expected int but got chunks='x' (type=str)"),
        ("ddp_join:world_size=2,backend=mpi", "backend='mpi' is not allowed: expected one of auto, gloo, nccl"),
        ("ddp_join:world_size=2,steps=3", "'steps=3' is not allowed: ddp_join takes world_size=..., backend=..., chunks=..., "
                                          "gradient_as_bucket_view=..., bucket_cap_mb=..., static_graph=..."),
        ("ddp_join:world_size=2,bucket_cap_mb=0", "bucket_cap_mb=0.0 is not allowed: expected a finite number > 0"),
        ("ddp_join:world_size=13", "world_size=13 is not allowed: expected an integer from 1 to 12"),
        ("ddp_join:world_size=2,chunks=7", "chunks=7 is not allowed: expected an integer from 1 to 6"),
    ],
)
def test_bad_options_name_option_value_and_what_is_allowed(spec, message):
    with pytest.raises(ec.InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        ec.check(CASE, [spec])
