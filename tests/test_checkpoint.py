"""Activation checkpointing inside accumulation: exact, with less activation memory; without the RNG
state preserved, dropout's replay draws other masks, and that is caught."""

import equivcheck as ec
from equivcheck import Verdict


def test_checkpoint_matches_full_batch_and_keeps_fewer_activations():
    report = ec.check("block_stack", ["accumulate:chunks=3", "checkpoint:chunks=3"])
    plain = report.outcome("block_stack", "accumulate:chunks=3")
    checkpointed = report.outcome("block_stack", "checkpoint:chunks=3")
    assert checkpointed.verdict is Verdict.EQUIVALENT and checkpointed.comparison.margin < 1e-2
    # Saved for backward at the peak: only each micro-batch's input, not its blocks' activations.
    assert checkpointed.memory.peak_bytes < plain.memory.peak_bytes / 3, (checkpointed.memory, plain.memory)


def test_checkpoint_replays_dropout_and_its_twin_without_rng_state_is_caught():
    report = ec.check("checkpoint_dropout")
    assert report.outcome("checkpoint_dropout", "checkpoint:chunks=4").verdict is Verdict.EQUIVALENT
    wrong = report.outcome("checkpoint_dropout", "checkpoint_without_rng_state:chunks=4")
    assert wrong.verdict is Verdict.EXPECTED_MISMATCH and wrong.comparison.margin > 100
