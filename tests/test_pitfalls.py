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


# --- what each pitfall regime declares: its class of bug and its faithful twin ---------------------

def _declaring():
    from equivcheck.regimes import BUILT_IN
    return [cls for cls in BUILT_IN if cls.pitfall]


def _example(cls):
    """An instance of ``cls`` that is the pitfall: every required parameter at its example value (as spec errors
    suggest); a family whose default is its faithful member at the setting that is the bug."""
    import dataclasses
    if cls.name == "per_token":
        return ec.parse_regime("per_token:detach=1")
    required = [f for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    return ec.parse_regime(cls.name + (":" + ",".join(f"{f.name}={f.metadata.get('example', 2)}" for f in required)
                                       if required else ""))


def test_every_pitfall_regime_declares_one():
    """A summary that says PITFALL, and the per_token family (seed 002's detach), declare it: removing one fails."""
    from equivcheck.regimes import BUILT_IN, Pitfall
    said = {cls.name for cls in BUILT_IN if cls.summary.startswith("PITFALL")} | {"per_token"}
    declared = {cls.name: cls.pitfall for cls in _declaring()}
    assert said <= set(declared), said - set(declared)
    assert all(isinstance(pitfall, Pitfall) for pitfall in declared.values()), declared


def test_a_declaration_is_never_inherited_unread():
    """A subclass of a pitfall says what it is itself (a scaler step per micro-batch has another twin)."""
    from equivcheck.regimes import BUILT_IN
    inheriting = [cls.name for cls in BUILT_IN
                  if any(base.__dict__.get("pitfall") for base in cls.__mro__[1:]) and "pitfall" not in vars(cls)]
    assert not inheriting


@pytest.mark.parametrize("cls", _declaring(), ids=lambda cls: cls.name)
def test_each_declaration_names_a_faithful_twin_and_a_class_the_audit_knows(cls):
    from equivcheck.suites.audit import BUG_CLASSES
    regime = _example(cls)
    twin = cls.pitfall.twin_of(regime)
    assert ec.parse_regime(str(twin)) == twin and twin.name == cls.pitfall.twin.partition(":")[0]
    # Not a pitfall itself: a faithful class, or its family's faithful member (per_token:detach=0), its own twin.
    assert not type(twin).pitfall or type(twin).pitfall.twin_of(twin) == twin, twin
    assert twin != regime
    assert cls.pitfall.bugs and set(cls.pitfall.bugs) <= set(BUG_CLASSES), cls.pitfall.bugs


@pytest.mark.parametrize(("spec", "twin"), [
    ("naive_accumulate:chunks=4", "accumulate:chunks=4"),
    ("clip_per_micro_batch:chunks=5,max_norm=0.1", "accumulate:chunks=5"),  # the case's optimizer clips, not the twin
    ("scaler_step_per_micro_batch:chunks=3", "scaler_accumulate:chunks=3"),
    ("per_token:detach=1", "per_token"),
    ("ddp_mean_loss:world_size=3,backend=gloo", "ddp:world_size=3,backend=gloo"),
    ("ddp_hook_mean_loss:world_size=2,hook=bf16", "ddp_hook:world_size=2,hook=bf16"),
    ("ddp_detached_partial_in_forward:world_size=2,chunks=3", "ddp_detached_partial_last_outside:world_size=2,chunks=3"),
    ("pipeline_mean_loss:stages=2,microbatches=4,schedule=1f1b", "pipeline:stages=2,microbatches=4,schedule=1f1b"),
])
def test_a_twin_keeps_every_parameter_it_shares_with_its_pitfall(spec, twin):
    regime = ec.parse_regime(spec)
    assert str(type(regime).pitfall.twin_of(spec)) == twin
