"""Where a run parts: one bug planted in one place at a time, each located at its step, phase and module, in
process, on DDP ranks, on a tensor-parallel mesh and under a team's own step; and nothing replayed where a check is
equivalent."""

import json

import pytest

import equivcheck as ec
from equivcheck.render.rows import to_rows

import located_bugs as bugs

pytestmark = pytest.mark.usefixtures("locating")


def where(outcome):
    location = outcome.location
    assert location is not None, outcome.describe()
    return location.step, location.phase, location.module


def test_a_check_asked_not_to_locate_replays_nothing():
    outcome = ec.check(bugs.BACKWARD, ["accumulate:chunks=3"], locate=False).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.location is None


def test_an_equivalent_check_is_not_located_and_replays_nothing(monkeypatch):
    from equivcheck.runners import tracing

    traced = []
    monkeypatch.setattr(tracing, "StepTracer", lambda *a: traced.append(a) or pytest.fail("traced"))
    report = ec.check(bugs.CLEAN, ["accumulate:chunks=3", "sample_by_sample"])
    assert report.ok and all(o.location is None for o in report.outcomes) and not traced


# FSDP2's ranks hold shards of every weight, yet each computes whole modules on its own rows: its records join as DDP's
@pytest.mark.parametrize("regime", ["accumulate:chunks=3", "ddp:world_size=2", "fsdp:world_size=2"])
def test_a_wrong_forward_in_a_blocks_own_code_is_located_there(regime):
    outcome = ec.check(bugs.FORWARD, [regime]).outcome(bugs.FORWARD.name, regime)
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert where(outcome) == (0, "forward", "blocks.1")
    assert "its own code" in outcome.location.matched


@pytest.mark.parametrize("regime", ["accumulate:chunks=3", "ddp:world_size=2", "fsdp:world_size=2"])
def test_a_wrong_forward_in_a_layer_with_weights_of_its_own_is_located_in_that_layer(regime):
    outcome = ec.check(bugs.LAYER_FORWARD, [regime]).outcome(bugs.LAYER_FORWARD.name, regime)
    assert where(outcome) == (0, "forward", "blocks.1.fc2")  # FSDP2's shards of its weights are storage alone


@pytest.mark.parametrize("regime", ["accumulate:chunks=3", "ddp:world_size=2", "fsdp:world_size=2"])
def test_a_wrong_backward_in_a_blocks_own_code_is_located_there_not_at_the_embedding(regime):
    outcome = ec.check(bugs.BACKWARD, [regime]).outcome(bugs.BACKWARD.name, regime)
    assert where(outcome) == (0, "backward", "blocks.1")
    text = outcome.describe().splitlines()
    assert text[2].startswith("parts at step 0, backward in `blocks.1`"), text[:3]  # the culprit in the first lines
    assert "detach" not in outcome.comparison.hint  # the hint that blamed a cut backward upstream is dropped


@pytest.mark.parametrize(("regime", "expected"), [
    ("naive_accumulate:chunks=5", (0, "loss", "")),
    ("ddp_mean_loss:world_size=5", (0, "loss", "")),
    ("zero_grad_inside:chunks=3", (0, "gradient", "emb")),
    ("clip_per_micro_batch:chunks=3,max_norm=0.01", (0, "gradient", "emb")),
    ("step_per_micro_batch:chunks=3", (0, "optimizer", "")),
    ("ddp_padded_sampler:world_size=5", (0, "forward", "")),
])
def test_the_pitfall_regimes_part_in_their_phase(regime, expected):
    outcome = ec.check(bugs.CLEAN, [regime]).outcome(bugs.CLEAN.name, regime)
    assert outcome.verdict is ec.Verdict.MISMATCH and where(outcome) == expected


@pytest.mark.parametrize(("step", "expected"), [
    (bugs.stepped_twice_at_first, (0, "optimizer", "")),
    (bugs.decays_weights_after_the_step, (0, "optimizer", "emb")),
    (bugs.halves_lr_after_each_step, (1, "state", "")),
    (bugs.scales_head_gradient, (0, "gradient", "head")),
])
def test_a_teams_step_is_located(step, expected):
    outcome = ec.check_step(bugs.CLEAN, step).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH and where(outcome) == expected


@pytest.mark.parametrize(("step", "expected"), [
    (bugs.restarts_the_random_stream, (0, "state", "")),  # the same input, masks drawn from another state
    (bugs.drops_a_quarter, (0, "forward", "2")),  # the same state, another rate
])
def test_a_dropout_that_draws_other_masks_is_told_from_one_computed_otherwise(step, expected):
    outcome = ec.check_step("dropout_one_layer", step).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH and where(outcome) == expected


def test_a_layer_left_out_of_the_all_reduce_is_a_communication_fault_in_that_layer():
    outcome = ec.check_step(bugs.CLEAN, bugs.head_left_out_of_all_reduce, world_size=2).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert where(outcome) == (0, "communication", "head")
    assert "never reduced" in outcome.location.matched


def test_tensor_parallel_pitfalls_are_located():
    report = ec.check("tp_mlp", ["tp_loss_scaled:world_size=2", "tp_different_batches:world_size=2"])
    assert where(report.outcome("tp_mlp", "tp_loss_scaled:world_size=2")) == (0, "loss", "")
    assert where(report.outcome("tp_mlp", "tp_different_batches:world_size=2"))[:2] == (0, "forward")


def test_the_location_reaches_every_report():
    report = ec.check(bugs.BACKWARD, ["accumulate:chunks=3"])
    row = to_rows(report)[0]
    location = report.outcomes[0].location
    assert row["location"] == {"step": 0, "phase": "backward", "module": "blocks.1", "tensor": location.tensor,
                               "margin": location.margin, "matched": location.matched, "own_code": True,
                               "forwards": 3, "below_tolerance": False, "in_shards": False}
    json.dumps(row)
    from equivcheck.render.html import render_html
    from equivcheck.render.markdown import render_markdown

    assert "parts at step 0, backward in `blocks.1`" in render_markdown([row])
    assert "parts at step 0, backward in" in render_html([row], {})
    with pytest.raises(ec.NotEquivalent, match=r"parts at step 0, backward in `blocks.1`"):
        report.assert_equivalent()


def test_a_replay_that_does_not_train_as_the_run_did_says_no_location():
    """The guard that holds each replay to the run it replays: a step that misbehaves on its first call in the process
    only is caught, but its replay trains right, so its records cannot say where the run parted."""
    bugs._MEDDLED.clear()
    outcome = ec.check_step(bugs.CLEAN, bugs.scales_head_gradient_once_per_process).outcomes[0]
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.location is None
    assert "where it parts is unsaid: replayed with hooks, the run read another gradient of 'head.weight'" in \
        outcome.reason
