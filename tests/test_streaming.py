"""A check of a large model compares its runs with the reference as they train, keeping none of their tensors
(compare.Measurement, check.COMPARE_AS_IT_TRAINS_FROM): the same verdicts and figures as a recorded check, found
with one recording in memory instead of three."""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import tempfile

import pytest
import torch

import equivcheck as ec
from equivcheck.judge.compare import Expected, tolerance_of
from equivcheck.regimes import register_regime
from equivcheck.regimes.local import FullBatch
from equivcheck.runners.train import train

check_module = sys.modules["equivcheck.check"]  # the package's `check` is the function


@pytest.fixture
def streamed(monkeypatch):
    """Every check compares as it trains, however small its case."""
    monkeypatch.setattr(check_module, "COMPARE_AS_IT_TRAINS_FROM", 0)


def figures(outcome: ec.Outcome) -> tuple:
    return outcome.case, outcome.regime, outcome.verdict, outcome.reason, outcome.comparison


# The catalogue compared as it trains against its recorded rows: tests/test_catalogue.py (one run of them shared).


def test_a_run_compared_as_it_trains_keeps_no_tensor_and_measures_what_compare_measures():
    reference = ec.run("mlp", "full_batch")
    tolerance = tolerance_of(reference)
    for spec in ("accumulate:chunks=3", "full_batch", "naive_accumulate:chunks=3"):
        streamed = train("mlp", spec, against=Expected(reference, tolerance))
        assert streamed.recorded_bytes == 0 and streamed.measured is not None
        assert streamed.optimizer_steps == reference.optimizer_steps
        assert ec.compare(reference, streamed) == ec.compare(reference, ec.run("mlp", spec))


def test_a_measurement_is_read_only_at_the_tolerance_it_was_taken_at():
    reference = ec.run("mlp", "full_batch")
    streamed = train("mlp", "accumulate:chunks=3", against=Expected(reference, tolerance_of(reference)))
    with pytest.raises(ec.InvalidArgument, match=r"^tolerance=rtol=0.5, atol=0.5 is not allowed here: the candidate "
                                                 r"was compared as it trained, at rtol=1e-07, atol=1e-07"):
        ec.compare(reference, streamed, rtol=0.5, atol=0.5)


def test_a_mismatch_found_as_it_trains_is_trained_again_for_its_hint(streamed):
    def step(model, optimizer, batch):  # a sum where the mean belongs: every gradient 12 x the reference's
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="sum").backward()
        optimizer.step()

    outcome = ec.check_step("mlp", step).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert outcome.comparison.hint.startswith("every gradient is 12 x the reference's from step 0")
    assert outcome.result.measured is None and outcome.result.recorded_bytes > 0


def test_the_self_check_compares_as_it_trains_and_still_catches_a_reference_that_disagrees_with_itself(streamed):
    draws = iter(range(100))

    def step(model, optimizer, batch):  # a different loss weight on every run: nondeterministic
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) * (1 + next(draws))
        loss.backward()
        optimizer.step()

    report = ec.check_step("mlp", step, reference=step, per_run=False)
    assert {o.verdict for o in report.outcomes} == {ec.Verdict.NONDETERMINISTIC}
    assert report.outcomes[0].comparison.mismatches


def test_a_regime_that_matches_only_when_trained_again_says_it_disagrees_with_itself(streamed):
    runs = iter(range(100))

    def step(model, optimizer, batch):  # its first run doubles the loss, every later one is faithful
        scale = 2.0 if next(runs) == 0 else 1.0
        optimizer.zero_grad()
        (torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) * scale).backward()
        optimizer.step()

    def make_step():
        return step

    outcome = ec.check_step("mlp", make_step, per_run=True).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert outcome.comparison.problems[-1] == ("the regime disagrees with itself: trained again to record its "
                                               "tensors, it matched the reference")


def test_a_non_finite_gradient_found_as_it_trains_is_the_same_error(monkeypatch):
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        model[2].bias.grad[1] = math.inf
        optimizer.step()

    recorded = ec.check_step("mlp", step).outcomes[0]
    monkeypatch.setattr(check_module, "COMPARE_AS_IT_TRAINS_FROM", 0)
    streamed = ec.check_step("mlp", step).outcomes[0]
    assert streamed.verdict is recorded.verdict is ec.Verdict.ERROR
    assert streamed.reason == recorded.reason
    assert streamed.reason.startswith("NonFinite: non-finite gradient of '2.bias' at step 0 under step:")


def test_clipping_is_said_to_engage_from_the_norms_a_run_compared_as_it_trains_notes(monkeypatch):
    specs, reference = ["accumulate:chunks=3,max_norm=0.05"], "full_batch:max_norm=0.05"
    recorded = ec.check("mlp", specs, reference=reference).outcomes[0]
    monkeypatch.setattr(check_module, "COMPARE_AS_IT_TRAINS_FROM", 0)
    streamed = ec.check("mlp", specs, reference=reference).outcomes[0]
    assert streamed.result.measured is not None
    assert streamed.reason == recorded.reason and "clipping engaged at 3 of 3 steps" in streamed.reason


def test_ranks_compare_as_they_train_and_leave_no_file_of_the_reference(streamed, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where this process writes the reference for its ranks
    folders = []
    make_folder = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: folders.append(make_folder(**kw)) or folders[-1])
    report = ec.check("mlp", ["ddp:world_size=2", "accumulate:chunks=3", "ddp:world_size=3"])
    assert {o.verdict for o in report.outcomes} == {ec.Verdict.EQUIVALENT}
    ranks = report.outcome("mlp", "ddp:world_size=2").result
    assert ranks.measured is not None and ranks.recorded_bytes == 0 and ranks.rank_spread == 0.0
    assert ranks.rank_grad_spread is None  # read from recordings, for a hint: a mismatch is recorded again
    assert len([f for f in folders if "equivcheck-reference-" in f]) == 1  # one file for every rank of both runs
    gc.collect()
    assert not list(tmp_path.glob("equivcheck-reference-*"))  # gone with the reference


training_module = sys.modules["equivcheck.runners.train"]


@register_regime
@dataclasses.dataclass(frozen=True)
class FullBatchThatScalesGradientsAfterItsStep(FullBatch):
    """Full batch, but each gradient is halved in place after the step uses it, then let go: the numbers of full
    batch, and a write to every tensor a recording that keeps them holds."""

    name = "full_batch_scaling_gradients_after_its_step"
    summary = "full batch that halves each gradient in place after its step (a test's)"

    def train_step(self, model, optimizer, batch, objective):
        loss = objective.sum(objective.forward(model, batch.inputs, batch.targets), batch.targets) / batch.items
        objective.backward(loss)
        optimizer.step()
        for parameter in model.parameters():
            parameter.grad.mul_(0.5)
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def test_full_batch_keeps_the_gradients_its_steps_used_and_a_write_after_the_step_means_copies(monkeypatch):
    """A regime that lets go of its gradients after each step is recorded without copies; one that wrote to them
    after the step is trained again, copying, and records what each step used."""
    copies = []
    snapshot = training_module.snapshot
    monkeypatch.setattr(training_module, "snapshot",
                        lambda named, *args, copy=True, **kw: copies.append(copy) or snapshot(named, *args, copy=copy, **kw))
    full = train("mlp", "full_batch")
    assert copies.count(True) == 0  # the gradients kept as they were; the final weights are never copied
    scaled = train("mlp", FullBatchThatScalesGradientsAfterItsStep())
    assert copies.count(True) == 3  # the kept gradients were written to: trained again, each step's copied
    assert all(torch.equal(full.grads[step][name], scaled.grads[step][name])
               for step in range(3) for name in full.grads[step])
    train("mlp", "accumulate:chunks=2")
    assert copies.count(True) == 6  # a regime that does not say it lets go of them is copied from the start
