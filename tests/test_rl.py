"""RL losses aggregated over tokens and sequences (issue 67): each of the trainers' four modes, declared once
(``ec.Aggregated``), holds every faithful regime to the one global objective, and each pitfall of the class is caught
and located at ``loss``, in its mode's own case."""

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck_cases.rl import FAITHFUL, KL_WEIGHT, MASK, RL_CASES, VALUE_WEIGHT, kl_penalty, policy_gradient, value_loss

pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it

PITFALLS = ["naive_accumulate:chunks=5", "ddp_mean_loss:world_size=2", "terms_per_micro_batch:chunks=3",
            "accumulate_divided_twice:chunks=3"]


@pytest.mark.parametrize("mode", ec.AGGREGATIONS)
def test_every_mode_is_one_global_objective_under_the_faithful_regimes_and_its_pitfalls_part_at_the_loss(mode):
    case = RL_CASES[mode]
    faithful = FAITHFUL[1:]
    outcomes = {o.regime: o for o in ec.check(case, [*faithful, *PITFALLS], locate=True).outcomes}
    for spec in faithful:
        assert outcomes[spec].verdict is Verdict.EQUIVALENT, outcomes[spec].describe()
    for spec in PITFALLS:
        caught = outcomes[spec]
        assert caught.verdict is Verdict.EXPECTED_MISMATCH and caught.comparison.margin > 100, caught.describe()
        assert caught.location is not None and caught.location.phase == "loss", caught.describe()


@pytest.mark.parametrize(("mode", "values"), [
    ("token-mean", [1.0, 2.0, 3.0]),  # the three counted tokens
    ("seq-mean-token-mean", [1.5, 3.0]),  # each sequence with any token: its mean
    ("seq-mean-token-sum", [3.0, 3.0, 0.0]),  # every sequence: its sum
    ("seq-mean-token-sum-norm", [1.5, 1.5, 0.0]),  # every sequence: its sum over the constant length 2
])
def test_each_mode_gives_one_value_per_unit(mode, values):
    losses = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    aggregated = ec.Aggregated(lambda output, targets: losses, lambda targets: mask, mode,
                               2 if mode == "seq-mean-token-sum-norm" else 0)
    assert aggregated.loss(None, mask).tolist() == values
    assert aggregated.units(mask) == len(values)


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(mode="token-sum"), "mode='token-sum' is not allowed: expected one of 'token-mean'"),
    (dict(mode="seq-mean-token-sum-norm"), "length=0 is not allowed"),
    (dict(mode="token-mean", length=5), "length=5 is not allowed: expected 0 \\(left out\\)"),
])
def test_a_mode_or_length_out_of_place_is_refused_naming_it(arguments, message):
    with pytest.raises(ec.InvalidArgument, match=message):
        ec.Aggregated(lambda output, targets: targets, lambda targets: targets, **arguments)


def token_mean_step(model, optimizer, batch):
    """A team's step: every term's mean over the global batch's response tokens, one backward, one step."""
    tokens, targets = batch
    output, counted = model(tokens), targets[..., MASK].bool()
    loss = sum(weight * per_token(output, targets)[counted].mean()
               for per_token, weight in ((policy_gradient, 1.0), (kl_penalty, KL_WEIGHT), (value_loss, VALUE_WEIGHT)))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.parametrize("mode", ec.AGGREGATIONS)
def test_a_teams_step_is_held_to_the_mode_its_case_declares(mode):
    """The same token-mean step is the objective of the token-mean case, and another one's: the declaration binds."""
    (outcome,) = ec.check_step(RL_CASES[mode], token_mean_step, locate=True).outcomes
    if mode == "token-mean":
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    else:
        assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 100, outcome.describe()
        assert outcome.location.phase == "loss", outcome.describe()
