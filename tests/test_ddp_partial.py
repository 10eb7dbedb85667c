"""Seed 000 under DDP: the faithful construction (trunk and head each in DDP, the head under no_sync()
for all but its last chunk) matches full batch with one all-reduce per wrapped module per step and
saves head memory; each naive version is caught with its message; DataParallel is skipped here."""

import dataclasses

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.judge.hints import unsynchronised_ranks
from equivcheck.regimes.ddp_partial import DataParallelDetachedPartial
from equivcheck.runners.train import train

CASE = "seed000_ddp"
FAITHFUL = "ddp_detached_partial:world_size=2,chunks=3"
LAST_OUTSIDE = "ddp_detached_partial_last_outside:world_size=2,chunks=3"
# The ranks import this module to find them: registered at the top level.
LAMBDA_SPLIT = ec.register_case(dataclasses.replace(ec.get_case(CASE), name="seed000_ddp_lambda_split",
                                                    split=lambda m: (lambda x: m[0](x), m[1]), regimes=None))


def frozen_trunk_model():
    model = ec.get_case(CASE).model()
    model[0].requires_grad_(False)
    return model


FROZEN_TRUNK = ec.register_case(dataclasses.replace(ec.get_case(CASE), name="seed000_ddp_frozen_trunk",
                                                    model=frozen_trunk_model, regimes=None))


@pytest.fixture(scope="module")
def report():
    return ec.check(CASE)


def test_the_seed_case_is_as_declared(report):
    report.assert_equivalent()
    assert {o.regime: o.verdict for o in report.outcomes} == {
        "full_batch": Verdict.EQUIVALENT,
        "ddp:world_size=2": Verdict.EQUIVALENT,
        FAITHFUL: Verdict.EQUIVALENT,
        LAST_OUTSIDE: Verdict.EQUIVALENT,
        "ddp_detached_partial_bypass:world_size=2,chunks=3": Verdict.EXPECTED_MISMATCH,
        "ddp_detached_partial_in_forward:world_size=2,chunks=3": Verdict.EXPECTED_MISMATCH,
        "ddp_detached_partial_sync_every_chunk:world_size=2,chunks=3": Verdict.EXPECTED_MISMATCH,
        "data_parallel_detached_partial:chunks=3": (Verdict.SKIPPED if torch.cuda.device_count() < 2
                                                    else Verdict.EQUIVALENT),
    }


@pytest.mark.parametrize("spec", [FAITHFUL, LAST_OUTSIDE])
def test_faithful_one_all_reduce_per_wrapped_module_per_step_with_headroom(report, spec):
    faithful = report.outcome(CASE, spec)
    assert faithful.result.syncs == (2, 2) and faithful.result.sync_wrappers == 2  # the trunk's and the head's
    assert faithful.comparison.margin < 1e-2  # headroom above 100
    assert faithful.result.rank_grad_spread == ((0.0, 0.0), (0.0, 0.0))


def test_the_seed_shape_is_faithful_only_with_its_last_backward_after_the_forward(report):
    """The same AccumulatingHead, the same chunks: the one difference is where the last backward runs."""
    inside = report.outcome(CASE, "ddp_detached_partial_in_forward:world_size=2,chunks=3")
    after = report.outcome(CASE, LAST_OUTSIDE)
    assert after.verdict is Verdict.EQUIVALENT and not inside.comparison.ok
    assert after.result.peak_activation_bytes == report.outcome(CASE, FAITHFUL).result.peak_activation_bytes


def test_faithful_saves_head_memory_against_plain_ddp(report):
    plain = report.outcome(CASE, "ddp:world_size=2").result.peak_activation_bytes
    partial = report.outcome(CASE, FAITHFUL).result.peak_activation_bytes
    # Per rank: 6 samples. Plain DDP keeps the head's log-softmax for all 6 (2400 B); the partial step for one
    # chunk of 2 (800 B). The trunk's graph (1152 B) and its output, the head's input (2400 B), stay whole.
    assert plain - partial >= 1550
    assert partial / plain < 0.75


def test_reaching_inside_one_wrapper_is_caught_and_named(report):
    bypass = report.outcome(CASE, "ddp_detached_partial_bypass:world_size=2,chunks=3")
    assert bypass.comparison.margin > 1e4
    assert bypass.comparison.hint.startswith("gradients were not all-reduced: at step 0 rank 1 held gradients")
    assert bypass.result.syncs == (0, 0)
    assert "communication: step 0 all-reduced gradients 0 time(s)" in "\n".join(bypass.comparison.problems)


def test_backward_inside_the_wrapped_forward_is_caught(report):
    inside = report.outcome(CASE, "ddp_detached_partial_in_forward:world_size=2,chunks=3")
    assert inside.comparison.margin > 1e4
    assert inside.comparison.hint.startswith("gradients were not all-reduced: at step 0")
    assert "(at step 0 only 1.bias, 1.weight differ from the reference's)" in inside.comparison.hint
    # DDP ignored the head's backward calls at step 0 (only the trunk's all-reduce); at step 1 the first
    # chunk's backward found DDP expecting hooks and all-reduced a partial sum.
    assert inside.result.syncs == (1, 2)
    head_only = {m.name for m in inside.comparison.mismatches if m.kind == "grad" and m.first_step == 0}
    assert head_only == {"1.weight", "1.bias"}


def test_syncing_the_head_every_chunk_is_caught_by_its_count(report):
    every = report.outcome(CASE, "ddp_detached_partial_sync_every_chunk:world_size=2,chunks=3")
    assert every.comparison.mismatches == () and every.comparison.margin < 1e-2  # the numbers are right
    assert every.result.syncs == (4, 4)
    assert every.comparison.problems == (
        f"communication: step 0 all-reduced gradients 4 time(s) ({every.result.sync_bytes[0]} bytes per rank); "
        "a faithful step does it 2 time(s) (1 per wrapped module, 2 wrapped)",)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the skip on a machine with fewer than 2 GPUs")
def test_data_parallel_is_skipped_with_its_reason(report):
    skipped = report.outcome(CASE, "data_parallel_detached_partial:chunks=3")
    assert skipped.reason == f"DataParallel needs at least 2 CUDA devices; {torch.cuda.device_count()} found"
    assert skipped.result is None


@pytest.mark.parametrize("spec", [FAITHFUL, LAST_OUTSIDE])
def test_a_trunk_with_nothing_to_train_is_not_wrapped(spec):
    """DDP refuses a module without trainable parameters; a frozen trunk has nothing to synchronise."""
    (outcome,) = ec.check(FROZEN_TRUNK, [spec]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT
    assert outcome.result.syncs == (1, 1) and outcome.result.sync_wrappers == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel is a pass-through only without CUDA")
def test_data_parallel_regime_code_runs_where_data_parallel_passes_through(monkeypatch):
    """Without CUDA, nn.DataParallel calls its module directly: this runs the regime's own code (the wrapping,
    the parts, the chunks, the trunk's backward) on the CPU, never a verdict on DataParallel itself."""
    monkeypatch.setattr(DataParallelDetachedPartial, "device", lambda self, asked="cpu": torch.device("cpu"))
    wrapped = train(CASE, "data_parallel_detached_partial:chunks=3")
    plain = train(CASE, "detached_partial:chunks=3")
    for step, grads in enumerate(plain.grads):
        for name, grad in grads.items():
            assert torch.equal(wrapped.grads[step][name], grad), (step, name)


def test_a_split_that_gives_no_modules_is_a_clear_error():
    with pytest.raises(ec.InvalidArgument, match="the case's split gave the trunk as function: expected an nn.Module"):
        ec.check(LAMBDA_SPLIT, [FAITHFUL])


def test_the_regimes_need_a_split_and_shards_to_chunk():
    with pytest.raises(ec.InvalidArgument, match="split=None is not allowed"):
        ec.check("seed004_linear", [FAITHFUL])
    with pytest.raises(ec.InvalidArgument, match="chunks=7 is not allowed: expected an integer from 1 to 6"):
        ec.check(CASE, ["ddp_detached_partial:world_size=2,chunks=7"])


def test_unsynchronised_ranks_names_the_step_and_the_ranks():
    result = ec.run("mlp", "full_batch")
    spread = ((0.0, 0.0, 0.0), (0.0, 1e-9, 3e-3), (0.0, 0.2, 0.0))
    assert unsynchronised_ranks(dataclasses.replace(result, rank_grad_spread=spread), 1e-7) == (1, (2,), 3e-3)
    assert unsynchronised_ranks(dataclasses.replace(result, rank_grad_spread=spread[:1]), 1e-7) is None
    assert unsynchronised_ranks(result, 1e-7) is None  # one process: nothing to disagree
