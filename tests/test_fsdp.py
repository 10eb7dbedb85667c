"""FSDP2 (fully_shard per block and root) on the warm pool: exact against full batch, its gradients read back
whole, its reduce-scatters counted; each equivalent verdict beside a real bug it catches."""

import parallel_bugs  # noqa: F401  (registers the bugs; the ranks import it by name)
import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.render.rows import to_rows
from equivcheck.errors import InvalidArgument
from equivcheck.strategies import CaseSpec

FSDP_SPECS = ["fsdp:world_size=2", "fsdp_no_sync:world_size=2,chunks=3",
              "fsdp_no_sync:world_size=2,chunks=3,reshard_after_forward=0"]


@pytest.fixture(scope="module")
def block_stack():
    return ec.check("block_stack", ["ddp:world_size=2", *FSDP_SPECS])


@pytest.mark.parametrize("spec", FSDP_SPECS)
def test_fsdp2_matches_full_batch_with_headroom(block_stack, spec):
    outcome = block_stack.outcome("block_stack", spec)
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.comparison


def test_fsdp2_reduce_scatters_once_per_block_per_step(block_stack):
    # embedding, 2 blocks, norm and head are sharded apart (the root holds no parameter of its own): 5 wrapped.
    for spec in FSDP_SPECS:
        result = block_stack.outcome("block_stack", spec).result
        assert result.sync_wrappers == 5 and result.syncs == (5, 5, 5), spec
    # 259 float64 parameters in all, each rank reduce-scatters the whole gradient (padded to 2 shards per block).
    assert block_stack.outcome("block_stack", "fsdp:world_size=2").result.sync_bytes[0] >= 259 * 8


def test_gradient_sync_left_on_is_caught_by_its_count():
    report = ec.check("fsdp_sync_every_micro_batch")
    every = report.outcome("fsdp_sync_every_micro_batch", "fsdp_sync_every_micro_batch:world_size=2,chunks=3")
    faithful = report.outcome("fsdp_sync_every_micro_batch", "fsdp_no_sync:world_size=2,chunks=3")
    assert faithful.verdict is Verdict.EQUIVALENT
    assert every.verdict is Verdict.EXPECTED_MISMATCH and every.comparison.margin < 1  # right numbers, wrong count
    assert every.result.syncs == (15, 15, 15)
    assert every.result.sync_bytes[0] == 3 * faithful.result.sync_bytes[0]
    assert every.comparison.problems[0].startswith(
        "communication: step 0 reduce-scattered gradients 15 time(s) (")
    assert every.comparison.problems[0].endswith("a faithful step does it 5 time(s) (1 per wrapped module, 5 wrapped)")


def test_twin_sync_never_turned_back_on_is_a_mismatch():
    """The no-sync twin: the last micro-batch left unsynchronised too, so no rank ever gets the reduced gradient."""
    outcome = ec.check("block_stack", ["fsdp_sync_never:world_size=2,chunks=3"]).outcomes[-1]
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 100


def test_twin_per_rank_mean_loss_is_a_mismatch_on_uneven_shards():
    """The fsdp twin: 11 samples over 2 ranks; FSDP2 averages ranks equally, so only the global-mean loss is right."""
    report = ec.check("ddp_uneven_shards", ["fsdp:world_size=2", "fsdp_mean_loss:world_size=2"])
    assert report.outcome("ddp_uneven_shards", "fsdp:world_size=2").verdict is Verdict.EQUIVALENT
    wrong = report.outcome("ddp_uneven_shards", "fsdp_mean_loss:world_size=2")
    assert wrong.verdict is Verdict.MISMATCH and wrong.comparison.margin > 100


def test_fsdp_specs_parse_and_print_back():
    regime = ec.parse_regime("fsdp_no_sync:world_size=2,chunks=3,reshard_after_forward=0")
    assert regime.reshard_after_forward is False
    assert str(regime) == "fsdp_no_sync:world_size=2,chunks=3,reshard_after_forward=0"
    assert ec.parse_regime(str(regime)) == regime
    with pytest.raises(InvalidArgument, match="fsdp takes world_size=..., backend=..., reshard_after_forward=..."):
        ec.parse_regime("fsdp:world_size=2,mesh=4")


def test_every_counted_collective_is_reported_by_kind_per_step(block_stack):
    fsdp = block_stack.outcome("block_stack", "fsdp_no_sync:world_size=2,chunks=3").result
    for step, syncs, sent in zip(fsdp.collectives, fsdp.syncs, fsdp.sync_bytes, strict=True):
        assert step["reduce_scatter"] == (syncs, sent)
        assert step["all_gather"][0] >= 2 * syncs  # each block's parameters gathered for forward and backward
    ddp = block_stack.outcome("block_stack", "ddp:world_size=2").result
    assert [step["all_reduce"][1] for step in ddp.collectives] == list(ddp.sync_bytes)
    row = next(r for r in to_rows(block_stack) if r["regime"] == "fsdp_no_sync:world_size=2,chunks=3")
    assert row["collectives"][0]["all_gather"] == {"calls": fsdp.collectives[0]["all_gather"][0],
                                                   "bytes": fsdp.collectives[0]["all_gather"][1]}


def test_ddp_all_reduces_one_call_per_bucket_once_it_has_rebuilt_its_buckets():
    """DDP trains its first step in one bucket and rebuilds them from the order gradients arrived."""
    result = ec.run("block_stack", "ddp:world_size=2,bucket_cap_mb=0.0001")
    calls = [step["all_reduce"][0] for step in result.collectives]
    assert result.syncs == (1, 1, 1) and calls[1] == calls[2] > 1


# A causal attention LM whose head is tied to its token embedding (GPT-2's layout): one parameter in two blocks.
TIED = ec.register_case(CaseSpec(widths=(8, 11), activation="gelu", dtype="float64", batch_size=6, steps=2,
                                 loss="cross_entropy", optimizer="adamw", lr=0.01, heads=2, block=4,
                                 attention_bias=True, tied=True).build())


@pytest.mark.parametrize("spec", ["fsdp:world_size=2", "fsdp_no_sync:world_size=2,chunks=2"])
def test_a_head_tied_to_the_embedding_is_sharded_with_it(spec):
    """FSDP2 refuses a parameter shared across two groups: the blocks that share it are left to the root."""
    (outcome,) = ec.check(TIED, [spec]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert outcome.result.sync_wrappers == 1  # trunk and head share the embedding: the root alone is sharded
