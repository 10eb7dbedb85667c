"""Maths or rounding: float32 mismatches weighed by float64 shadows of both runs."""

import dataclasses
import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.diff import Comparison
from equivcheck.precision import Tolerance
from equivcheck.precision import PRECISIONS, SCALED_SHADOW, SHADOW
from equivcheck.judge import rounding, witness
from equivcheck.judge.rounding import _noise_margin, _start_gap, applies, judge, shadow_of


def layernorm_over_two():
    return nn.Sequential(nn.Linear(6, 2), nn.LayerNorm(2), nn.Tanh(), nn.Linear(2, 3))


def data():
    return torch.randn(36, 6), torch.randint(0, 3, (36,))


# The minimal case: gradients at rounding level behind the LayerNorm, Adam makes them whole updates.
ILL = ec.Case(name="layernorm_over_two_adam", model=layernorm_over_two, data=data,
              loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=12, steps=3,
              optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), dtype=torch.float32)
SEED = 3  # the table alone gives margin 165 on one CPU, 71 on another (kernels differ by instruction set)


def test_an_ill_conditioned_float32_case_is_equivalent_with_a_note():
    reference, regime = ec.run(ILL, "full_batch", seed=SEED), ec.run(ILL, "accumulate:chunks=5", seed=SEED)
    table = ec.compare(reference, regime)
    assert table.margin > 10  # torch.testing's float32 table alone: a false alarm (165 on one CPU, 71 on another)
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.ok
    assert outcome.reason.startswith("ill-conditioned: LayerNorm over 2 features: gradients at rounding level, "
                                     "amplified by Adam")
    assert "the float64 runs match" in outcome.reason and f"margin {table.margin:.3g}" in outcome.reason
    assert outcome.comparison.margin <= 1 and outcome.comparison.note == outcome.reason
    # the figures the table measured stay readable beside the verdict
    assert (outcome.comparison.mismatches, outcome.comparison.problems) == ((), ())
    assert (outcome.comparison.max_abs, outcome.comparison.max_rel) == (table.max_abs, table.max_rel)
    assert "note: ill-conditioned" in outcome.comparison.describe()


def test_its_twin_a_real_pitfall_on_the_same_case_is_still_caught_by_its_float64_hint():
    (outcome,) = ec.check(ILL, ["zero_grad_inside:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert outcome.comparison.note.startswith("the float64 runs differ too")
    ref64, cand64 = (ec.run(ILL, spec, seed=SEED, dtype=SHADOW) for spec in ("full_batch", "zero_grad_inside:chunks=5"))
    float64 = ec.diagnose(ref64, cand64, ec.compare(ref64, cand64))
    assert outcome.comparison.hint == float64.hint and "zero_grad" in float64.hint


@pytest.mark.parametrize("as_it_trains", [False, True], ids=["recorded", "compared-as-it-trains"])
def test_a_shadow_that_starts_elsewhere_explains_nothing_and_blames_no_detach_or_rng(monkeypatch, as_it_trains):
    """A shadow drawing in float64 trains from other weights and data: its noise says nothing."""
    if as_it_trains:
        monkeypatch.setattr(sys.modules["equivcheck.check"], "COMPARE_AS_IT_TRAINS_FROM", 0)
    monkeypatch.setitem(PRECISIONS, SHADOW, dataclasses.replace(PRECISIONS[SHADOW], draw_dtype=torch.float64))
    (witnessed,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    # the witness (same precision, samples reordered) still tells rounding, where the shadows cannot
    assert witnessed.verdict is Verdict.EQUIVALENT and witnessed.reason.startswith("chaotic: LayerNorm over 2 features")
    monkeypatch.setattr(witness, "applies", lambda *args: False)  # the shadows' own judgement, alone
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert "did not start where its float32 run did" in outcome.comparison.hint
    assert outcome.comparison.hint.endswith("so the difference could not be attributed to rounding")
    assert outcome.comparison.note.startswith("the float64 runs match (margin ")
    assert "detach" not in outcome.comparison.hint and "RNG" not in outcome.comparison.hint


def test_the_shadow_draws_what_the_float32_run_draws():
    """torch draws other numbers in float64 than in float32: the shadow draws in float32, then computes in float64."""
    float32, shadow, float64 = (ec.run(ILL, "full_batch", seed=SEED, dtype=d) for d in ("float32", SHADOW, "float64"))
    assert abs(float32.losses[0] - shadow.losses[0]) < 1e-6
    assert abs(float32.losses[0] - float64.losses[0]) > 1e-3
    assert shadow.precision == SHADOW and shadow.weights["0.weight"].dtype == torch.float64


def counting_shadows(monkeypatch, against=False):
    """Every run a check starts, by its precision's name (and whether it is compared as it trains, with ``against``)."""
    calls = []
    module = sys.modules["equivcheck.check"]  # the package's ``check`` is the function
    original = module.start_request  # every run of a check begins here

    def counted(request, **kwargs):
        name = request.precision.name
        calls.append((name, kwargs.get("against") is not None) if against else name)
        return original(request, **kwargs)

    monkeypatch.setattr(module, "start_request", counted)
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


def test_compared_as_it_trains_the_shadows_settle_it_and_the_candidate_trains_once(monkeypatch):
    """A model large enough to be compared as it trains (here forced): its float64 candidate is compared with the
    float64 reference as it trains too, and where they match the float32 candidate is not trained again to record it
    (rounding.settled_as_it_trained). The runs: the reference, its repeat, the candidate, the two shadows."""
    monkeypatch.setattr(sys.modules["equivcheck.check"], "COMPARE_AS_IT_TRAINS_FROM", 0)
    calls = counting_shadows(monkeypatch, against=True)
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.ok, outcome.describe()
    assert outcome.reason.startswith("ill-conditioned: LayerNorm over 2 features: gradients at rounding level")
    assert "the float64 runs match (margin " in outcome.reason and "compared as they trained" in outcome.reason
    assert "the reference strays from its float64 shadow by up to" in outcome.reason
    assert calls == [("float32", False), ("float32", True), ("float32", True), (SHADOW, False), (SHADOW, True)]
    assert outcome.comparison.margin <= 1


def test_compared_as_it_trains_a_real_pitfall_is_still_caught_with_its_float64_hint(monkeypatch):
    """The twin: the float64 runs differ, so nothing is settled, and the candidate is trained again, recorded, for
    the breakdown and the shadows' hint, as a recorded check gives them."""
    monkeypatch.setattr(sys.modules["equivcheck.check"], "COMPARE_AS_IT_TRAINS_FROM", 0)
    (outcome,) = ec.check(ILL, ["zero_grad_inside:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert outcome.comparison.note.startswith("the float64 runs differ too") and "zero_grad" in outcome.comparison.hint


def test_only_a_low_precision_difference_in_numbers_goes_to_the_shadows():
    failing = Comparison(Tolerance(1e-3, 1e-4), (object(),), (), 1.0, 1.0, 2.0)
    assert applies(PRECISIONS["float32"], failing) and applies(PRECISIONS["bf16-autocast"], failing)
    assert applies(PRECISIONS["fp16-autocast"], failing)
    assert not applies(PRECISIONS["float64"], failing) and not applies(PRECISIONS[SHADOW], failing)
    assert not applies(PRECISIONS["float32"], dataclasses.replace(failing, problems=("optimizer steps: 5 vs 1",)))
    lossy = dataclasses.replace(failing, tolerance=Tolerance(1e-3, 1e-4, source="a compression's own bound"))
    assert not applies(PRECISIONS["float32"], lossy)  # its shadows would judge the compression at float64's bound


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


def quantities(grad=(0.0, 0.0), weight=0.0, buffer=0.0, loss=0.0):
    """What _noise_margin reads of a run: one step's gradients (an empty parameter first), a final weight and
    buffer, the loss series; values exact in binary, so every margin below is exact."""
    return SimpleNamespace(grads=({"empty": torch.zeros(0), "w": torch.tensor(grad)},),
                           weights={"w": torch.tensor([weight])}, buffers={"b": torch.tensor([buffer])}, losses=(loss,))


def test_each_runs_own_noise_widens_what_is_allowed_by_exactly_that_noise():
    # allowed = 0.25 + 0.5 * |2| + noise 0.5 (reference from its shadow) + noise 0.25 (regime from its own)
    reference, regime = quantities(grad=(2.0, 0.0)), quantities(grad=(3.0, 0.0))
    ref64, regime64 = quantities(grad=(1.5, 0.0)), quantities(grad=(3.25, 0.0))
    assert _noise_margin(reference, regime, ref64, regime64, Tolerance(rtol=0.5, atol=0.25)) == (0.5, 0.5, 0.25)


@pytest.mark.parametrize("where", ["grad", "weight", "buffer", "loss"])
def test_a_difference_in_any_compared_quantity_beyond_the_noise_sets_the_margin(where):
    """No noise (each run is its own shadow): |5 - 2| / (0.25 + 0.5 * 2) = 2.4, wherever the difference is."""
    reference = quantities(grad=(2.0, 2.0), weight=2.0, buffer=2.0, loss=2.0)
    regime = quantities(**{"grad": (2.0, 2.0), "weight": 2.0, "buffer": 2.0, "loss": 2.0, where: 5.0}
                        | ({"grad": (2.0, 5.0)} if where == "grad" else {}))
    assert _noise_margin(reference, regime, reference, regime, Tolerance(rtol=0.5, atol=0.25)) == (2.4, 0.0, 0.0)


def test_the_loss_series_is_weighed_in_float64_and_a_step_without_a_loss_is_left_out():
    step = 2.0 ** -30  # lost in float32: 1 + 2^-30 rounds to 1
    tol = Tolerance(rtol=0.0, atol=2.0 ** -31)
    reference, regime = quantities(loss=1.0), quantities(loss=1.0 + step)
    assert _noise_margin(reference, regime, reference, regime, tol)[0] == 2.0
    silent = quantities(loss=None)
    assert _noise_margin(silent, regime, silent, regime, tol)[0] == 0.0


def test_equal_numbers_match_even_where_nothing_is_allowed():
    reference, regime = quantities(grad=(1.0, 0.0)), quantities(grad=(1.0, 0.5))
    assert _noise_margin(reference, reference, reference, reference, Tolerance(rtol=0.0, atol=0.0))[0] == 0.0
    assert _noise_margin(reference, regime, reference, regime, Tolerance(rtol=0.0, atol=0.0))[0] == math.inf


def conditioning(*modules, optimizer=torch.optim.SGD):
    case = ec.Case(name="conditioning", model=lambda: nn.Sequential(*modules), data=data, loss=F.cross_entropy,
                   batch_size=12, steps=1, optimizer=lambda params: optimizer(params, lr=0.1))
    return rounding.conditioning(case, seed=0)


def test_the_note_names_each_normalisation_over_few_features_once_and_an_adaptive_optimizer():
    assert conditioning(nn.LayerNorm(4), optimizer=torch.optim.Adam) == (
        "LayerNorm over 4 features: gradients at rounding level, amplified by Adam (it scales each update to about "
        "its learning rate)")
    assert conditioning(nn.LayerNorm(1), nn.GroupNorm(2, 8), nn.GroupNorm(2, 8)) == (
        "LayerNorm over 1 feature, GroupNorm over 4 channels per group: gradients at rounding level")
    assert conditioning(nn.LayerNorm(5), nn.GroupNorm(1, 5)) == "rounding noise"


@pytest.mark.parametrize("reads_a_value, builds", [(False, ["meta"]), (True, ["meta", "cpu"])])
def test_the_note_reads_the_model_built_on_the_meta_device_and_builds_it_for_real_only_where_that_fails(
        reads_a_value, builds):
    built_on = []

    def model():
        built_on.append(torch.empty(0).device.type)
        norm = nn.LayerNorm(2)
        if reads_a_value:  # a factory that reads what it drew cannot build on the meta device
            float(norm.weight.detach().sum())
        return nn.Sequential(nn.Linear(3, 2), norm)

    case = ec.Case(name="built_on", model=model, data=data, loss=F.cross_entropy, batch_size=12, steps=1,
                   optimizer=lambda params: torch.optim.Adam(params, lr=0.1))
    assert rounding.conditioning(case, seed=0) == (
        "LayerNorm over 2 features: gradients at rounding level, amplified by Adam (it scales each update to about "
        "its learning rate)")
    assert built_on == builds


def test_shadows_that_cannot_run_leave_the_low_precision_verdict_and_say_why():
    failing = Comparison(Tolerance(1e-3, 1e-4), (object(),), (), 1.0, 1.0, 2.0, hint="a hint")

    def cannot_run():
        raise RuntimeError("no float64 here")

    judged = judge(ILL, failing, None, None, cannot_run, cannot_run, seed=SEED)
    assert judged == dataclasses.replace(failing, note="the float64 shadow runs failed: RuntimeError: no float64 here")


def test_where_the_float64_runs_differ_their_hint_replaces_the_low_precision_tables():
    ref64, cand64 = (ec.run(ILL, spec, seed=SEED, dtype=SHADOW) for spec in ("full_batch", "zero_grad_inside:chunks=5"))
    failing = Comparison(Tolerance(1e-3, 1e-4), (object(),), (), 1.0, 1.0, 2.0, hint="the float32 table's guess")
    judged = judge(ILL, failing, None, None, lambda: ref64, lambda: cand64, seed=SEED)
    float64 = ec.diagnose(ref64, cand64, ec.compare(ref64, cand64))
    assert judged.hint == float64.hint and "zero_grad" in judged.hint
    assert judged.note == f"the float64 runs differ too (margin {float64.margin:.3g}): the maths differs"
    assert judged.mismatches == failing.mismatches and judged.margin == failing.margin
