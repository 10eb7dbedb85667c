"""Maths or rounding: float32 mismatches weighed by float64 shadows of both runs."""

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.compare import Comparison, Tolerance
from equivcheck.precision import PRECISIONS, SCALED_SHADOW, SHADOW
from equivcheck.rounding import _start_gap, applies, shadow_of


def layernorm_over_two():
    return nn.Sequential(nn.Linear(6, 2), nn.LayerNorm(2), nn.Tanh(), nn.Linear(2, 3))


def data():
    return torch.randn(36, 6), torch.randint(0, 3, (36,))


# The minimal case: gradients at rounding level behind the LayerNorm, Adam makes them whole updates.
ILL = ec.Case(name="layernorm_over_two_adam", model=layernorm_over_two, data=data,
              loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=12, steps=3,
              optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), dtype=torch.float32)
SEED = 3  # the table alone gives margin 165 here


def test_an_ill_conditioned_float32_case_is_equivalent_with_a_note():
    reference, regime = ec.run(ILL, "full_batch", seed=SEED), ec.run(ILL, "accumulate:chunks=5", seed=SEED)
    assert ec.compare(reference, regime).margin > 100  # torch.testing's float32 table alone: a false alarm
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.ok
    assert outcome.reason.startswith("ill-conditioned: LayerNorm over 2 features: gradients at rounding level, "
                                     "amplified by Adam")
    assert "the float64 runs match" in outcome.reason and "margin 165" in outcome.reason
    assert outcome.comparison.margin <= 1 and outcome.comparison.note == outcome.reason
    assert "note: ill-conditioned" in outcome.comparison.describe()


def test_its_twin_a_real_pitfall_on_the_same_case_is_still_caught_by_its_float64_hint():
    (outcome,) = ec.check(ILL, ["zero_grad_inside:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert outcome.comparison.note.startswith("the float64 runs differ too")
    ref64, cand64 = (ec.run(ILL, spec, seed=SEED, dtype=SHADOW) for spec in ("full_batch", "zero_grad_inside:chunks=5"))
    float64 = ec.diagnose(ref64, cand64, ec.compare(ref64, cand64))
    assert outcome.comparison.hint == float64.hint and "zero_grad" in float64.hint


def test_a_shadow_that_starts_elsewhere_explains_nothing_and_blames_no_detach_or_rng(monkeypatch):
    """A shadow drawing in float64 trains from other weights and data: its noise says nothing."""
    monkeypatch.setitem(PRECISIONS, SHADOW, dataclasses.replace(PRECISIONS[SHADOW], draw_dtype=torch.float64))
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert "did not start where its float32 run did" in outcome.comparison.hint
    assert "detach" not in outcome.comparison.hint and "RNG" not in outcome.comparison.hint


def test_the_shadow_draws_what_the_float32_run_draws():
    """torch draws other numbers in float64 than in float32: the shadow draws in float32, then computes in float64."""
    float32, shadow, float64 = (ec.run(ILL, "full_batch", seed=SEED, dtype=d) for d in ("float32", SHADOW, "float64"))
    assert abs(float32.losses[0] - shadow.losses[0]) < 1e-6
    assert abs(float32.losses[0] - float64.losses[0]) > 1e-3
    assert shadow.precision == SHADOW and shadow.weights["0.weight"].dtype == torch.float64


def counting_shadows(monkeypatch):
    calls = []
    module = sys.modules["equivcheck.check"]  # the package's ``check`` is the function
    original = module.start  # every run of a check begins here

    def counted(*args, **kwargs):
        calls.append(kwargs.get("dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "start", counted)
    return calls


def test_no_shadow_runs_where_the_table_decides(monkeypatch):
    """The default float64 path, and float32 runs that match the table, run no float64 shadow."""
    calls = counting_shadows(monkeypatch)
    report = ec.check("naive_scaling_uneven_chunks", ["naive_accumulate:chunks=5", "accumulate:chunks=5"])
    assert [o.verdict for o in report.outcomes] == [Verdict.EXPECTED_MISMATCH, Verdict.EQUIVALENT]
    (outcome,) = ec.check("mlp", ["accumulate:chunks=5"], dtype="float32").outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.reason == ""
    assert SHADOW not in calls and len(calls) == 7


def test_the_shadow_reference_runs_once_per_check(monkeypatch):
    calls = counting_shadows(monkeypatch)
    report = ec.check(ILL, ["accumulate:chunks=5", "sample_by_sample", "retained_graph:chunks=4"], seed=SEED)
    assert all(o.verdict is Verdict.EQUIVALENT for o in report.outcomes)
    shadows = calls.count(SHADOW)
    assert shadows == 1 + sum(bool(o.reason) for o in report.outcomes) and shadows >= 2


def test_only_a_low_precision_difference_in_numbers_goes_to_the_shadows():
    failing = Comparison(Tolerance(1e-3, 1e-4), (object(),), (), 1.0, 1.0, 2.0)
    assert applies(PRECISIONS["float32"], failing) and applies(PRECISIONS["bf16-autocast"], failing)
    assert applies(PRECISIONS["fp16-autocast"], failing)
    assert not applies(PRECISIONS["float64"], failing) and not applies(PRECISIONS[SHADOW], failing)
    assert not applies(PRECISIONS["float32"], dataclasses.replace(failing, problems=("optimizer steps: 5 vs 1",)))


def test_a_scaled_mode_is_shadowed_through_its_scaler():
    """Without a GradScaler in the shadow, a step that bypasses the scaler would change nothing in float64
    and pass as rounding (test_precision's test_stepping_around_the_scaler_... fails then)."""
    scaled = dataclasses.replace(PRECISIONS["float32"], name="float32-scaled", grad_scaler=True)
    assert shadow_of(scaled) == SCALED_SHADOW and PRECISIONS[SCALED_SHADOW].grad_scaler
    assert shadow_of(PRECISIONS["float32"]) == shadow_of(PRECISIONS["bf16-autocast"]) == SHADOW


@pytest.mark.parametrize(("first", "again", "gap"), [
    (3.25, 2.0, None),  # |3.25 - 2| = 0.25 + 0.5 * 2 exactly: at the bound, still the same start
    (3.5, 2.0, "3.5 vs 2"),
    (0.75, 2.0, None),  # the same bound below
    (None, 2.0, None),  # a regime that reports no loss: nothing to compare
    (3.5, None, None),
])
def test_the_shadow_starts_where_the_run_did_within_the_modes_tolerance(first, again, gap):
    runs = (SimpleNamespace(losses=(first, 9.0)), SimpleNamespace(losses=(again, 9.0)))
    assert _start_gap(*runs, Tolerance(rtol=0.5, atol=0.25)) == gap
    assert _start_gap(SimpleNamespace(losses=()), runs[1], Tolerance(rtol=0.5, atol=0.25)) is None
