"""Reports that say what happened: step counts as counted, a logged loss named as such, a mean loss accepted.

Each is written as a user meets it: a team's step with the problem, the report it gets, and its twin.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import equivcheck as ec



def accumulating_step(model, optimizer, batch, micro_batches=4, step=True, logged_loss=False):
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
        loss = F.cross_entropy(model(x), y, reduction="sum") / len(targets)
        loss.backward()
    if step:
        optimizer.step()
    optimizer.zero_grad()
    # nanoGPT logs the last micro-batch's loss x K: close to the batch's mean, not it
    return loss.detach() * micro_batches if logged_loss else None


def test_a_step_that_never_steps_is_named_so():
    (outcome,) = ec.check_step("mlp", lambda m, o, b: accumulating_step(m, o, b, step=False)).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert outcome.comparison.hint.startswith("0 optimizer steps where the reference took 3: the code checked never "
                                              "called optimizer.step()")
    assert "per micro-batch" not in outcome.comparison.hint


def test_a_step_that_skips_some_batches_is_not_blamed_on_stepping_per_micro_batch():
    calls = []

    def off_by_one(model, optimizer, batch):
        calls.append(1)
        return accumulating_step(model, optimizer, batch, step=len(calls) % 2 == 1)

    (outcome,) = ec.check_step("mlp", off_by_one).outcomes
    assert outcome.comparison.hint.startswith("2 optimizer steps where the reference took 3 (per global batch: "
                                              "1, 0, 1): some global batches were never stepped")


def test_steps_counted_per_global_batch_show_their_pattern_not_an_average():
    """A step that steps per micro-batch in one batch only: 1, 1, 4, not "2 per global batch"."""
    calls = []

    def last_batch_per_micro_batch(model, optimizer, batch):
        calls.append(1)
        inputs, targets = batch
        for x, y in zip(inputs.tensor_split(4), targets.tensor_split(4)):
            (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
            if len(calls) == 3:
                optimizer.step()
        if len(calls) < 3:
            optimizer.step()
        optimizer.zero_grad()

    (outcome,) = ec.check_step("mlp", last_batch_per_micro_batch).outcomes
    assert outcome.result.steps_per_batch == (1, 1, 4)
    assert outcome.comparison.hint.startswith("6 optimizer steps where the reference took 3 (per global batch: 1, 1, 4)")


def test_a_whole_loop_gets_no_pattern_it_could_not_show():
    def loop(model, optimizer, batches):
        for inputs, targets in batches:
            for x, y in zip(inputs.tensor_split(2), targets.tensor_split(2)):
                (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
                optimizer.step()

    (outcome,) = ec.check_loop("mlp", loop).outcomes
    assert outcome.result.steps_per_batch is None
    assert outcome.comparison.hint.startswith("6 optimizer steps where the reference took 3: likely optimizer.step()")


def test_stepping_per_micro_batch_keeps_its_own_hint():
    (outcome,) = ec.check("mlp", ["step_per_micro_batch:chunks=4"]).outcomes
    assert outcome.comparison.hint.startswith("12 optimizer steps where the reference took 3 (4 per global batch)")


def test_a_logged_loss_fails_on_the_losses_alone_says_so_and_can_be_left_out():
    logged = lambda m, o, b: accumulating_step(m, o, b, logged_loss=True)  # noqa: E731
    (outcome,) = ec.check_step("mlp", logged).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert {m.kind for m in outcome.comparison.mismatches} == {"loss"}
    assert outcome.comparison.hint.startswith("only the reported losses differ; every gradient and weight matches")
    ec.check_step("mlp", logged, compare_losses=False).assert_equivalent()


def test_leaving_the_losses_out_still_catches_a_gradient_bug():
    def mean_over_k(model, optimizer, batch, micro_batches=5):
        inputs, targets = batch
        for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
            (F.cross_entropy(model(x), y) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()

    (outcome,) = ec.check_step("mlp", mean_over_k, compare_losses=False).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH and {m.kind for m in outcome.comparison.mismatches} >= {"grad"}


def test_compare_losses_takes_a_bool():
    with pytest.raises(ec.InvalidArgument, match="Expected bool but got compare_losses='no'"):
        ec.check("mlp", ["accumulate:chunks=2"], compare_losses="no")


# --- a loss that returns a mean, as every Hugging Face model's .loss does ---------------------------

def logits_and_loss(output, targets):
    """A model whose forward returns (logits, loss): the case's loss reads the mean it would compute."""
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits, targets)


MEAN_CASE = dataclasses.replace(ec.get_case("mlp"), name="mlp_mean_loss", loss=logits_and_loss, loss_reduction="mean")


def test_a_mean_loss_is_accepted_when_declared_and_every_regime_weights_it_by_its_items():
    report = ec.check(MEAN_CASE, ["accumulate:chunks=5", "sample_by_sample", "naive_accumulate:chunks=5"])
    verdicts = {o.regime: o.verdict for o in report.outcomes}
    assert verdicts["accumulate:chunks=5"] is ec.Verdict.EQUIVALENT
    assert verdicts["sample_by_sample"] is ec.Verdict.EQUIVALENT
    assert verdicts["naive_accumulate:chunks=5"] is ec.Verdict.MISMATCH  # mean / K over 3,3,2,2,2: still caught


def test_an_undeclared_mean_loss_is_refused_with_the_way_to_declare_it():
    undeclared = dataclasses.replace(MEAN_CASE, name="mlp_mean_undeclared", loss_reduction="none")
    with pytest.raises(ec.InvalidArgument, match=r"returned shape \(\) .*declare Case\(loss_reduction='mean'\)"):
        ec.check(undeclared, ["accumulate:chunks=2"])
    with pytest.raises(ec.InvalidArgument, match="loss_reduction='sum' is not allowed: expected 'none' or 'mean'"):
        dataclasses.replace(MEAN_CASE, loss_reduction="sum")


# --- communication alone, gradients alone ------------------------------------------------------------

def test_right_numbers_with_extra_all_reduces_get_their_own_verdict_and_a_gate_may_allow_it(capsys):
    from equivcheck.cli import main

    report = ec.check("mlp", ["ddp_sync_every_micro_batch:world_size=2,chunks=3", "ddp_no_sync:world_size=2,chunks=3"])
    extra, faithful = report.outcomes
    assert extra.verdict is ec.Verdict.COMMUNICATION and not extra.comparison.mismatches
    assert "all-reduced gradients 3 time(s)" in extra.comparison.problems[0]
    assert faithful.verdict is ec.Verdict.EQUIVALENT
    with pytest.raises(ec.NotEquivalent, match="1 of 2 checks failed"):
        report.assert_equivalent()
    report.assert_equivalent(allow_communication=True)
    args = ["run", "--case", "mlp", "--regime", "ddp_sync_every_micro_batch:world_size=2,chunks=3"]
    assert main(args) == 1 and main([*args, "--allow-communication"]) == 0
    capsys.readouterr()


def test_wrong_numbers_are_never_allowed_as_communication():
    report = ec.check("mlp", ["naive_accumulate:chunks=5"])
    assert report.outcomes[0].verdict is ec.Verdict.MISMATCH
    with pytest.raises(ec.NotEquivalent):
        report.assert_equivalent(allow_communication=True)


def test_gradients_that_differ_while_the_weights_match_are_said_to():
    """Adam (with a tiny eps) normalises a constant gradient scale away: a loss x 2 changes only the gradients."""
    adam = dataclasses.replace(ec.get_case("mlp"), name="mlp_adam_tiny_eps",
                               optimizer=lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-12))

    def doubled_loss(model, optimizer, batch):
        inputs, targets = batch
        (2 * F.cross_entropy(model(inputs), targets)).backward()
        optimizer.step()
        optimizer.zero_grad()

    (outcome,) = ec.check_step(adam, doubled_loss).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert outcome.reason.startswith("only the gradients recorded at optimizer.step() differ; the final weights")
    (plain,) = ec.check_step(dataclasses.replace(adam, name="mlp_adam_sgd", optimizer=ec.default_optimizer),
                             doubled_loss).outcomes
    assert plain.verdict is ec.Verdict.MISMATCH and plain.reason == ""  # SGD carries the scale into the weights
