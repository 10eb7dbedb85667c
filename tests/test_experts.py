"""Routed experts with an objective of several terms, each normalised over its own unit (cases/experts.py)."""

from __future__ import annotations

import dataclasses

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.runners.ranks.pool import _exception_line

FAITHFUL = ["accumulate:chunks=3", "accumulate:chunks=5", "sample_by_sample", "ddp:world_size=2",
            "ddp_no_sync:world_size=2,chunks=2", "fsdp:world_size=2", "ep:world_size=2", "ep:world_size=4",
            "fsdp_ep:dp=2,ep=2", "fsdp_ep:dp=1,ep=2"]
PITFALLS = ["ddp_aux_over_world:world_size=2", "ddp_aux_times_world:world_size=2", "ep_experts_averaged:world_size=2",
            "fsdp_ep_experts_over_dp:dp=2,ep=2"]


def test_each_term_normalised_over_its_own_unit_is_honoured_by_every_regime_and_aux_scaling_bugs_are_caught():
    """A sequence-wise balance loss over sequences and a z-loss over real tokens beside the LM loss over real tokens:
    every cut of the batch adds up to the full batch's objective, the experts spread over 2 and 4 expert-parallel ranks
    too, and on a dp x ep mesh (FSDP2 over the dense parameters). Under DDP the aux terms averaged without the world
    size (aux / dp) and scaled by it twice are caught; under expert parallelism the experts' gradients averaged over the
    ep ranks, and on the mesh averaged over their replicas only."""
    report = ec.check("routed_tokens", [*FAITHFUL, *PITFALLS])
    for spec in FAITHFUL:
        outcome = report.outcome("routed_tokens", spec)
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    for spec in PITFALLS:
        outcome = report.outcome("routed_tokens", spec)
        assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 1000, outcome.describe()


def test_a_sequence_wise_term_counted_per_token_is_not_the_same_objective():
    """The false alarm one per-item loss gave: the balance term weighted by tokens is another objective, so the
    units a term declares are what make micro-batches add up (the check is not blind to them)."""
    routed = ec.get_case("routed_tokens")
    balance, z_loss = routed.terms
    by_tokens = dataclasses.replace(balance, loss=lambda output, targets: output[1].repeat_interleave(
        (targets != -100).sum(1)), units=z_loss.units)
    case = dataclasses.replace(routed, name="balance_by_tokens", terms=(by_tokens, z_loss), regimes=None,
                               expect_mismatch={})
    reference = ec.run("routed_tokens", "full_batch")
    weighted = ec.run(case, "full_batch")
    assert ec.compare(reference, weighted).margin > 100


def test_a_term_of_the_wrong_shape_or_an_aux_pitfall_without_terms_is_refused_naming_it():
    case = ec.get_case("routed_tokens")
    scalar = dataclasses.replace(case, name="scalar_aux", regimes=None, expect_mismatch={},
                                 terms=(ec.Term("load_balance", loss=lambda output, targets: output[1].mean()),))
    with pytest.raises(ec.InvalidArgument, match=r"term 'load_balance' of case 'scalar_aux' returned shape \(\) for "
                                                 r"12 samples holding 12 of its units: expected a 1-D tensor"):
        ec.run(scalar, "full_batch")
    with pytest.raises(ec.InvalidArgument, match=r"terms=.* is not allowed: expected a tuple of ec.Term"):
        dataclasses.replace(case, terms=("load_balance",))
    with pytest.raises(ec.InvalidArgument, match="no terms= beside its loss"):
        ec.check("tokens", ["ddp_aux_over_world:world_size=2"])


def test_a_workers_exception_is_named_by_its_first_line_when_its_message_holds_indented_lines():
    traceback = ('Traceback (most recent call last):\n  File "x.py", line 1, in f\n    fully_shard(block)\n'
                 '    ^^^^^^^^^^^^^^^^^^\nValueError: fully_shard does not support containers: ModuleList(\n'
                 '  (0-3): 4 x Linear()\n)\n')
    assert _exception_line(traceback) == "ValueError: fully_shard does not support containers: ModuleList("


def test_expert_parallelism_exchanges_tokens_by_all_to_all_counted_per_step_and_reads_each_expert_from_its_rank():
    """Per step: the counts, the tokens out and back, and their two gradients (5 all_to_all over ep) and one
    all-reduce of the dense gradients; each expert's weights read from the rank that trains it (the other ranks' copies
    never move), so the final weights match where a read of the local copy would not."""
    (outcome,) = ec.check("routed_tokens", ["ep:world_size=2"]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    for step in outcome.result.collectives:
        assert {kind: calls for kind, (calls, _) in step.items()} == {"all_to_all[ep]": 5, "all_reduce[ep]": 1}
    (mesh,) = ec.check("routed_tokens", ["fsdp_ep:dp=2,ep=2"]).outcomes  # FSDP2's over every rank, experts over dp
    assert {kind: calls for kind, (calls, _) in mesh.result.collectives[0].items()} == {
        "all_gather[world]": 1, "reduce_scatter[world]": 1, "all_to_all[ep]": 5, "all_reduce[dp]": 1}


def test_expert_parallelism_needs_a_model_that_declares_its_experts_and_a_count_the_ranks_divide():
    with pytest.raises(ec.InvalidArgument, match="the model declares no experts: expected a module holding experts"):
        ec.check("mlp", ["ep:world_size=2"])
    with pytest.raises(ec.InvalidArgument, match="holds 4 experts: expected a multiple of ep=3"):
        ec.check("routed_tokens", ["ep:world_size=3"])


def test_a_batch_wise_balance_is_declared_non_equivalent_under_a_cut_and_the_verdict_says_why():
    """Its expert counts are the whole batch's: a micro-batch or a rank sees only its own, so no cut can give the full
    batch's gradient. The case declares it, and the verdict carries the case's reason: never a silent mismatch."""
    full, accumulated, ranks = ec.check("routed_batch_balance").outcomes[:3]
    assert full.verdict is Verdict.EQUIVALENT
    for outcome in (accumulated, ranks):
        assert outcome.verdict is Verdict.EXPECTED_MISMATCH and "non-equivalent by construction" in outcome.reason


def test_an_aux_loss_free_bias_moved_at_each_optimizer_step_is_equivalent_and_moved_per_micro_batch_is_caught():
    """The bias chooses the experts; moved after each optimizer step from the tokens routed since (summed over the
    ranks) it is the full batch's under accumulation, one sample at a time, DDP and FSDP2; moved in a backward hook it
    moves per micro-batch, and the next micro-batch routes by a bias the full batch never had."""
    for outcome in ec.check("routed_bias").outcomes:
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    (per_micro_batch,) = ec.check("routed_bias_per_micro_batch", ["accumulate:chunks=4"]).outcomes
    assert per_micro_batch.verdict is Verdict.EXPECTED_MISMATCH and per_micro_batch.comparison.margin > 100, \
        per_micro_batch.describe()
    moved = ec.run("routed_bias", "full_batch").buffers["expert_bias"]
    assert moved.abs().sum() > 0  # the bias did move: the faithful rows compare a real balancing
