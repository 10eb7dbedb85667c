"""Every guard behind a verdict, each under a test that fails when the guard is weakened.

Each test here was written against a single-line bug planted in the harness (an error counted as
expected, the rank-drift guard comparing rank 0 with itself or only flagging drift above 1.0, the
reference self-check at a loose tolerance, numpy left unseeded, the fast comparison path skipping
steps) and fails with that bug in place.
"""

import dataclasses
import itertools
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.process.seeding import seeded


def numpy_data():
    """Data drawn with numpy's global RNG, as many pipelines do: equivcheck must seed it everywhere."""
    inputs = torch.from_numpy(np.random.standard_normal((12, 6)))
    targets = torch.from_numpy(np.random.randint(0, 3, 12))
    return inputs, targets


# One step, registered at the top level: the DDP ranks import this module to find the case and the steps.
ONE_STEP = ec.register_case(ec.Case(
    name="guard_numpy_one_step", model=lambda: nn.Linear(6, 3), data=numpy_data,
    loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=12, steps=1,
))


def ddp_step(model, optimizer, batch):
    """A faithful DDP step on this rank's even shard: its mean, which DDP averages over the ranks."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def ddp_step_only_rank_0_steps(model, optimizer, batch):
    """Wrong: only rank 0 steps, so rank 0 holds the right weights and the other replicas stay behind."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    if dist.get_rank() == 0:
        optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def failing_step(model, optimizer, batch):
    raise RuntimeError("the team's step is broken")


def test_an_error_verdict_fails_the_report():
    """A team step that raises must fail the CI gate, not pass it as 'as expected'."""
    report = ec.check_step(ONE_STEP, failing_step)
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.ERROR and not outcome.verdict.as_expected
    assert not report.ok and report.failures == (outcome,)
    with pytest.raises(ec.NotEquivalent, match="the team's step is broken"):
        report.assert_equivalent()


@pytest.mark.parametrize("as_it_trains", [False, True], ids=["recorded", "compared-as-it-trains"])
def test_ranks_that_drift_apart_are_caught_even_when_rank_0_matches(monkeypatch, as_it_trains):
    """Rank 0's gradients and weights equal the reference on a 1-step case: only the rank-drift guard
    sees that rank 1 never stepped (its weights differ by far less than 1), from the ranks' recordings, or measured on
    the ranks where they compare with the reference as they train (a large model's check)."""
    if as_it_trains:
        monkeypatch.setattr(sys.modules["equivcheck.check"], "COMPARE_AS_IT_TRAINS_FROM", 0)
    faithful, drifting = (ec.check_step(ONE_STEP, step, world_size=2).outcomes[0]
                          for step in (ddp_step, ddp_step_only_rank_0_steps))
    assert (drifting.result.measured is not None) is as_it_trains
    assert faithful.verdict is Verdict.EQUIVALENT and faithful.result.rank_spread == 0
    assert drifting.verdict is Verdict.MISMATCH
    assert not drifting.comparison.mismatches  # the numbers of rank 0 alone match
    assert 0 < drifting.result.rank_spread < 1
    (problem,) = drifting.comparison.problems
    assert problem.startswith("ranks disagree: their final weights differ by up to")
    assert problem.endswith(", rank 1 against rank 0)") and "(at '" in problem  # the parameter and the ranks named


def test_a_single_rank_has_no_drift():
    assert ec.run(ONE_STEP, "ddp:world_size=1").rank_spread == 0.0


def test_data_drawn_with_numpy_is_the_same_in_every_run_and_on_every_rank():
    with seeded(5):
        first = np.random.standard_normal(4)
    with seeded(5):
        assert np.array_equal(np.random.standard_normal(4), first)
    report = ec.check(ONE_STEP, ["accumulate:chunks=3", "ddp:world_size=2", "ddp:world_size=3"])
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * 3


def test_its_twin_data_drawn_unseeded_is_caught():
    """The same numpy draws from a generator equivcheck does not seed: the self-check says so."""
    generator = np.random.default_rng()
    case = dataclasses.replace(ONE_STEP, name="guard_unseeded_numpy",
                               data=lambda: (torch.from_numpy(generator.standard_normal((12, 6))),
                                             torch.from_numpy(generator.integers(0, 3, 12))))
    (outcome,) = ec.check(case, ["accumulate:chunks=3"]).outcomes
    assert outcome.verdict is Verdict.NONDETERMINISTIC


def test_data_that_drifts_slightly_is_nondeterministic_not_a_regime_mismatch():
    """Inputs that move by 1e-4 per call: far inside a loose 1e-2, far outside float64's tolerance.
    The reference's self-check must be as strict as the comparison it guards."""
    draws = itertools.count()
    base = ec.get_case("mlp")

    def drifting_data():
        inputs, targets = base.data()
        return inputs + 1e-4 * next(draws), targets

    case = dataclasses.replace(base, name="slightly_drifting", data=drifting_data)
    report = ec.check(case, ["accumulate:chunks=4"])
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.NONDETERMINISTIC
    assert outcome.comparison.margin > 1 and "disagrees with itself" in outcome.reason


@pytest.fixture(scope="module")
def reference():
    return ec.run("mlp", "full_batch")


def at_step(result, step, name="2.weight", delta=1e-3):
    """``result`` with one gradient element moved at ``step`` only: weights and losses untouched."""
    grads = [dict(g) for g in result.grads]
    grads[step][name] = grads[step][name].clone()
    grads[step][name][1, 4] += delta
    return dataclasses.replace(result, grads=tuple(grads))


@pytest.mark.parametrize("step", [0, 1, 2])
def test_a_gradient_that_differs_at_one_step_only_is_a_mismatch(reference, step):
    """Every step's gradients count, not only the first or the last: the verdict, not just a figure."""
    assert ec.compare(reference, reference).ok  # the twin: untouched, it matches
    comparison = ec.compare(reference, at_step(reference, step))
    assert not comparison.ok
    (mismatch,) = comparison.mismatches
    assert (mismatch.kind, mismatch.name, mismatch.first_step) == ("grad", "2.weight", step)


@pytest.mark.parametrize("step", [0, 1, 2])
def test_a_loss_that_differs_at_one_step_only_is_a_mismatch(reference, step):
    losses = list(reference.losses)
    losses[step] += 1e-3
    comparison = ec.compare(reference, dataclasses.replace(reference, losses=tuple(losses)))
    assert not comparison.ok
    (mismatch,) = comparison.mismatches
    assert (mismatch.kind, mismatch.first_step) == ("loss", step)


def test_every_step_of_a_regime_run_is_compared(reference):
    """A real run: the regime's gradients from another step swapped in at the last step are caught."""
    candidate = ec.run("mlp", "accumulate:chunks=4")
    grads = candidate.grads[:-1] + (candidate.grads[0],)
    (outcome,) = [ec.compare(reference, dataclasses.replace(candidate, grads=grads))]
    assert ec.compare(reference, candidate).ok and not outcome.ok
    assert outcome.first_divergent_step == len(grads) - 1
    assert torch.is_tensor(candidate.grads[0]["2.weight"])


@pytest.mark.parametrize(("case", "verdict", "reason"), [
    ("declared_fault_raise", Verdict.EXPECTED_MISMATCH, "it crashed: WorkerError: job declared_fault_raise"),
    ("declared_fault_kill", Verdict.ERROR, "rank 1 died (killed by SIGKILL)"),
])
def test_only_the_code_raising_counts_as_a_declared_pitfall_crashing(case, verdict, reason):
    """A rank killed (by the OOM killer, a load spike's timeout) says nothing about the code checked."""
    import fault_cases  # noqa: F401  (registers the cases; ranks import it by name)

    (outcome,) = ec.check(case, ["ddp:world_size=2"]).outcomes
    assert outcome.verdict is verdict and reason in outcome.reason
