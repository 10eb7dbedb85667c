"""Pitfall regimes: specs, bad input, and the measured behaviour each one is built on."""

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.regimes import Chunked, backward_chunks, finish_step


@pytest.mark.parametrize("spec", ["zero_grad_inside:chunks=5", "clip_per_micro_batch:chunks=5,max_norm=0.1",
                                  "per_token:detach=1", "replayed_dropout:chunks=4", "sampler_pad:chunks=5",
                                  "scaler_unscale_per_micro_batch:chunks=3"])
def test_specs_round_trip(spec):
    assert str(ec.parse_regime(spec)) == spec


@pytest.mark.parametrize(("spec", "case", "message"), [
    ("per_token:detach=2", "gru_decoder", "detach=2 is not allowed: expected 0 \\(full BPTT\\) or 1"),
    ("clip_per_micro_batch:chunks=2,max_norm=0", "mlp", "max_norm=0.0 is not allowed: expected a finite number > 0"),
    ("clip_per_micro_batch:chunks=2,max_norm=big", "mlp", "Expected float but got max_norm='big'"),
    ("per_token", "seed004_linear", "split=None is not allowed"),
    ("per_token", "mlp", "has no initial_hidden\\(\\)"),
])
def test_bad_pitfall_specs(spec, case, message):
    with pytest.raises(ec.InvalidArgument, match=message):
        ec.check(case, [spec])


def test_one_dropout_layer_draws_the_global_masks_in_order_on_cpu():
    """Measured, not assumed: with one dropout layer plain accumulation matches; with two it does not."""
    assert ec.check("dropout_one_layer").ok
    (outcome,) = ec.check("dropout_two_layers", ["accumulate:chunks=4"]).outcomes
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.first_divergent_step == 0


def test_replayed_dropout_leaves_the_rng_stream_as_full_batch_does():
    """Steps after the first draw the same masks as full batch only if the replay consumed the same stream."""
    (outcome,) = ec.check("dropout_two_layers", ["replayed_dropout:chunks=3"]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and ec.get_case("dropout_two_layers").steps == 3


def test_even_samplers_change_nothing():
    """12 samples in 4 equal micro-batches: nothing to pad or drop, so the sampler regimes are exact."""
    report = ec.check("mlp", ["sampler_pad:chunks=4", "sampler_drop:chunks=4"])
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * 2


def test_clipping_is_active_in_the_reference():
    """Without the case's clip the reference would differ: so the twin's match is not vacuous."""
    clipped, plain = ec.run("clip_per_micro_batch", "full_batch"), ec.run("mlp", "full_batch")
    assert not ec.compare(plain, clipped).ok
    norm = torch.cat([g.reshape(-1) for g in clipped.grads[0].values()]).norm()
    assert float(norm) == pytest.approx(0.1, rel=1e-4)  # clip_grad_norm_ divides by norm + 1e-6


class ForgetsDivideByK(Chunked):
    name = "forgets_divide_by_k"
    summary = "test bug: micro-batch mean without / K"

    def train_step(self, model, optimizer, batch, objective):
        loss = backward_chunks(objective.forward_of(model), batch.inputs, batch.targets, self.chunks, objective.mean,
                               objective=objective)
        finish_step(optimizer, objective)
        return loss


def test_a_constant_factor_is_named_as_loss_scaling():
    (outcome,) = ec.check("mlp", [ForgetsDivideByK(4)]).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert outcome.comparison.hint.startswith("every gradient is 4 x the reference's from step 0: likely loss scaling")
    assert "hint: every gradient is 4 x" in outcome.describe()
