"""The comparator: it reports every mismatched quantity, where it started and by how much."""

import dataclasses
import math

import pytest
import torch

import equivcheck as ec
from equivcheck.diff import Comparison, Mismatch, TensorDiff
from equivcheck.precision import PRECISIONS, Tolerance
from equivcheck.result import RunResult

from equivcheck import diff as diff_module


@pytest.fixture(scope="module")
def reference():
    return ec.run("mlp", "full_batch")


def moved(tensor, index, delta):
    tensor = tensor.clone()
    tensor[index] += delta
    return tensor


def perturbed(result, *, step=0, name="2.weight", index=(1, 4), delta=1e-3, kind="grads"):
    """A copy of ``result`` with one element of one gradient (from ``step`` on) or final weight moved."""
    if kind == "grads":
        grads = tuple(
            {n: moved(g, index, delta) if n == name and s >= step else g for n, g in step_grads.items()}
            for s, step_grads in enumerate(result.grads)
        )
        return dataclasses.replace(result, grads=grads)
    return dataclasses.replace(result, weights={**result.weights, name: moved(result.weights[name], index, delta)})


def test_identical_runs_match_with_zero_margin(reference):
    cmp = ec.compare(reference, ec.run("mlp", "full_batch"))
    assert cmp.ok and cmp.margin == 0 and cmp.mismatches == () and cmp.first_divergent_step is None


def test_one_bad_element_is_located(reference):
    cmp = ec.compare(reference, perturbed(reference, step=1))
    assert not cmp.ok
    (mismatch,) = cmp.mismatches
    assert (mismatch.kind, mismatch.name, mismatch.first_step) == ("grad", "2.weight", 1)
    assert mismatch.diff.mismatched == 1 and mismatch.diff.total == 30
    assert mismatch.diff.abs_index == (1, 4)
    assert mismatch.diff.max_abs == pytest.approx(1e-3, rel=1e-6)
    expected = reference.grads[mismatch.worst_step]["2.weight"][1, 4]
    allowed = 1e-7 + 1e-7 * abs(float(expected))
    assert mismatch.diff.abs_allowed == pytest.approx(allowed)
    assert mismatch.diff.margin == pytest.approx(1e-3 / allowed, rel=1e-6)
    assert cmp.first_divergent_step == 1
    text = cmp.describe()
    for fragment in ("grad of '2.weight' mismatched from step 1", "Mismatched elements: 1 / 30",
                     "Greatest absolute difference: 0.001 at index (1, 4)", "Margin:"):
        assert fragment in text


def test_every_mismatched_parameter_is_reported(reference):
    bad = perturbed(perturbed(reference, step=2, name="0.bias", index=(3,), delta=1.0), step=0)
    bad = perturbed(bad, kind="weights", name="0.weight", index=(0, 0))
    names = {(m.kind, m.name, m.first_step) for m in ec.compare(reference, bad).mismatches}
    assert names == {("grad", "2.weight", 0), ("grad", "0.bias", 2), ("weight", "0.weight", None)}


def test_error_inside_tolerance_matches(reference):
    cmp = ec.compare(reference, perturbed(reference, step=0, delta=1e-9))
    assert cmp.ok and 0 < cmp.margin < 1


def test_tolerance_override_and_dtype_default(reference):
    bad = perturbed(reference, step=0, delta=1e-4)
    assert not ec.compare(reference, bad).ok
    assert ec.compare(reference, bad, rtol=0.0, atol=1e-3).ok
    assert ec.compare(reference, bad).tolerance == ec.Tolerance(1e-7, 1e-7)


def test_step_count_difference_is_a_problem(reference):
    extra = dataclasses.replace(reference, grads=reference.grads + reference.grads[-1:])
    cmp = ec.compare(reference, extra)
    assert not cmp.ok
    assert cmp.problems == ("optimizer steps: the reference took 3, the candidate 4",)


def test_nan_is_never_equivalent(reference):
    cmp = ec.compare(reference, perturbed(reference, step=2, delta=math.nan))
    assert not cmp.ok and cmp.margin == math.inf


def test_loss_mismatch_reports_its_step(reference):
    losses = list(reference.losses)
    losses[1] += 1e-3
    losses[2] += 1.0
    (mismatch,) = ec.compare(reference, dataclasses.replace(reference, losses=tuple(losses))).mismatches
    assert (mismatch.kind, mismatch.first_step, mismatch.worst_step) == ("loss", 1, 2)
    assert "from step 1 (worst at step 2)" in mismatch.describe(ec.Tolerance.resolve(torch.float64))


@pytest.mark.parametrize(("rtol", "atol"), [(1e-7, None), (None, 1e-7), (-1.0, 1.0), ("0.1", 1.0), (0.0, 0.0)])
def test_bad_tolerances_are_named(reference, rtol, atol):
    with pytest.raises(ec.InvalidArgument, match="rtol|atol"):
        ec.compare(reference, reference, rtol=rtol, atol=atol)


@pytest.mark.parametrize("spec", ["accumulate:chunks=4", "accumulate:chunks=5", "sample_by_sample"])
def test_matching_runs_report_the_figures_of_every_quantity(reference, spec):
    """The vectorised path for matching runs gives the maxima a per-quantity TensorDiff gives."""
    candidate = ec.run("mlp", spec)
    cmp = ec.compare(reference, candidate)
    tol = cmp.tolerance
    pairs = [(c[n], r[n]) for r, c in zip(reference.grads, candidate.grads) for n in r]
    pairs += [(candidate.weights[n], w) for n, w in reference.weights.items()]
    pairs.append((torch.tensor(candidate.losses, dtype=torch.float64), torch.tensor(reference.losses, dtype=torch.float64)))
    diffs = [TensorDiff.of(actual, expected, tol) for actual, expected in pairs]
    assert cmp.ok and cmp.margin > 0
    assert cmp.max_abs == max(d.max_abs for d in diffs)
    assert cmp.max_rel == max(d.max_rel for d in diffs)
    assert cmp.margin == max(d.margin for d in diffs)


def test_one_element_just_past_tolerance_leaves_the_fast_path(reference):
    """A single element beyond tolerance among matching ones still surfaces with its breakdown."""
    cmp = ec.compare(reference, perturbed(reference, kind="weights", name="0.bias", index=(3,), delta=5e-7))
    assert not cmp.ok
    (mismatch,) = cmp.mismatches
    assert (mismatch.kind, mismatch.name, mismatch.diff.abs_index) == ("weight", "0.bias", (3,))


def test_compare_measures_and_diagnose_names_the_pitfall_once(reference):
    """The comparator only measures; the hint is diagnosis's, which ``ec.check`` calls and never overrides."""
    doubled = dataclasses.replace(reference, grads=tuple({n: 2 * g for n, g in step.items()} for step in reference.grads[:1])
                                  + reference.grads[1:])
    measured = ec.compare(reference, doubled)
    assert not measured.ok and measured.hint == ""
    named = ec.diagnose(reference, doubled, measured)
    assert named.hint.startswith("every gradient is 2 x the reference's from step 0: likely loss scaling")
    assert dataclasses.replace(named, hint="") == measured
    kept = dataclasses.replace(measured, hint="the float64 shadows' hint")
    assert ec.diagnose(reference, doubled, kept).hint == "the float64 shadows' hint"
    matching = ec.compare(reference, ec.run("mlp", "full_batch"))
    assert ec.diagnose(reference, reference, matching).hint == ""


def test_a_final_weight_that_alone_differs_is_described_as_final():
    reference = ec.run("mlp", "full_batch")
    moved = dataclasses.replace(reference, weights={n: w + 1 for n, w in reference.weights.items()})
    comparison = ec.compare(reference, moved)
    assert {m.kind for m in comparison.mismatches} == {"weight"}
    assert all(m.first_step is None for m in comparison.mismatches)
    assert "mismatched final:" in comparison.mismatches[0].describe(comparison.tolerance)


def test_a_verdict_reads_whole_in_this_order_note_hint_problems_then_each_mismatch():
    tol = Tolerance(rtol=0.5, atol=0.25)
    diff = TensorDiff(mismatched=1, total=4, max_abs=3.0, abs_index=(2,), abs_allowed=1.25, max_rel=1.5, rel_index=(2,),
                      margin=2.4)
    failing = Comparison(tol, (Mismatch("grad", "w", 1, 2, diff),), ("optimizer steps: 3 vs 1",), 3.0, 1.5, 2.4,
                         hint="the hint", note="the note")
    text = ("not equivalent (rtol=0.5, atol=0.25): margin 2.4, max abs 3\nnote: the note\nhint: the hint\n"
            "optimizer steps: 3 vs 1\ngrad of 'w' mismatched from step 1 (worst at step 2):\n"
            "  Mismatched elements: 1 / 4 (25.0%)\n"
            "  Greatest absolute difference: 3 at index (2,) (up to 1.25 allowed)\n"
            "  Greatest relative difference: 1.5 at index (2,) (up to 0.5 allowed)\n"
            "  Margin: 2.4 (error / allowed error)")
    assert failing.describe() == text
    scalar = TensorDiff(mismatched=1, total=1, max_abs=3.0, abs_index=(), abs_allowed=1.25, max_rel=1.5, rel_index=(),
                        margin=2.4)  # a 0-d tensor (the loss) has no index to name
    assert Mismatch("loss", "loss", 0, 0, scalar).describe(tol).splitlines()[2:4] == [
        "  Greatest absolute difference: 3 (up to 1.25 allowed)",
        "  Greatest relative difference: 1.5 (up to 0.5 allowed)"]
    assert Comparison(tol, (), (), 0.0, 0.0, 0.5).describe() == "equivalent: margin 0.5 (rtol=0.5, atol=0.25)"
    outcome = ec.Outcome("mlp", "accumulate:chunks=2", ec.Verdict.MISMATCH, failing, reason="why")
    assert outcome.describe() == "mlp under accumulate:chunks=2: mismatch (why)\n" + text
    assert dataclasses.replace(outcome, verdict=ec.Verdict.EQUIVALENT).describe() == (
        "mlp under accumulate:chunks=2: equivalent (why)")


TOL = Tolerance(rtol=0.5, atol=0.25)


def run_of(grad=(2.0, 0.0), weight=1.0, buffer=1.0, loss=2.0, names=("w",)):
    """A run to compare, its numbers exact in binary so every figure below is exact."""
    return RunResult(case="c", regime="r", losses=(loss,), grads=({n: torch.tensor(grad) for n in names},),
                     weights={n: torch.tensor([weight]) for n in names}, buffers={"b": torch.tensor([buffer])},
                     seconds=0.0)


def test_an_equivalent_pair_has_the_figures_of_its_greatest_differences():
    reference, candidate = run_of(), run_of(grad=(2.625, 0.0))  # 0.625 of the 1.25 allowed at 2; 0/0: no difference
    assert ec.compare(reference, candidate, tolerance=TOL) == Comparison(TOL, (), (), 0.625, 0.3125, 0.5)


@pytest.mark.parametrize("where", ["grad", "weight", "buffer", "loss"])
def test_a_margin_just_above_one_anywhere_is_a_mismatch(where):
    reference = run_of(grad=(2.0, 2.0), weight=2.0, buffer=2.0, loss=2.0)
    moved = {"grad": (2.0, 3.875), "weight": 3.875, "buffer": 3.875, "loss": 3.875}[where]  # 1.875 / 1.25 = 1.5
    candidate = run_of(**{"grad": (2.0, 2.0), "weight": 2.0, "buffer": 2.0, "loss": 2.0, where: moved})
    comparison = ec.compare(reference, candidate, tolerance=TOL)
    assert not comparison.ok and comparison.margin == 1.5 and comparison.mismatches[0].kind == where


def test_every_difference_in_structure_is_named():
    reference = run_of()
    for candidate, problem in [
        (dataclasses.replace(run_of(), grads=()), "optimizer steps: the reference took 1, the candidate 0"),
        (run_of(names=("v",)), "weight names differ: ['v', 'w']"),
        (run_of(grad=(2.0, 0.0, 0.0)), "grad of 'w': candidate has (3,), reference (2,)"),
        (dataclasses.replace(run_of(), grads=({},)), "grad of 'w': candidate has None, reference (2,)"),
        (dataclasses.replace(run_of(), buffers={"c": torch.tensor([1.0])}), "buffer names differ: ['b', 'c']"),
    ]:
        assert problem in ec.compare(reference, candidate, tolerance=TOL).problems
    fewer = ec.compare(reference, dataclasses.replace(run_of(), grads=()), tolerance=TOL)
    assert (fewer.max_abs, fewer.max_rel, fewer.margin, fewer.mismatches) == (0.0, 0.0, 0.0, ())  # the rest is equal


def test_an_empty_parameter_has_nothing_to_differ():
    reference, candidate = run_of(grad=()), run_of(grad=())
    assert ec.compare(reference, candidate, tolerance=TOL) == Comparison(TOL, (), (), 0.0, 0.0, 0.0)
    assert TensorDiff.of(torch.zeros(0), torch.zeros(0), TOL) == TensorDiff(0, 0, 0.0, (), 0.0, 0.0, (), 0.0)
    moved = dataclasses.replace(candidate, weights={"w": torch.tensor([9.0])})
    assert ec.compare(reference, moved, tolerance=TOL).mismatches[0].name == "w"  # the breakdown runs past it


def test_a_tensor_difference_in_torch_testings_figures():
    expected = torch.tensor([[0.0, 2.0], [1.0, 8.0]])
    actual = torch.tensor([[0.0, 3.875], [1.75, 11.0]])  # ratios 0, 1.5, exactly 1 (within), 3 / 4.25
    assert TensorDiff.of(actual, expected, TOL) == TensorDiff(
        mismatched=1, total=4, max_abs=3.0, abs_index=(1, 1), abs_allowed=4.25, max_rel=0.9375, rel_index=(0, 1),
        margin=1.5)


def test_the_loss_series_names_its_first_and_worst_step_and_each_steps_margin():
    reference = dataclasses.replace(run_of(), losses=(2.0, 2.0, 2.0, 2.0))
    candidate = dataclasses.replace(run_of(), losses=(2.0, 3.25, 3.875, 2.5))  # margins 0, 1, 1.5, 0.4
    (mismatch,) = ec.compare(reference, candidate, tolerance=TOL).mismatches
    assert (mismatch.kind, mismatch.name, mismatch.first_step, mismatch.worst_step) == ("loss", "loss", 2, 2)
    assert mismatch.step_margins == (0.0, 1.0, 1.5, 0.4)
    # Weighed in float64: 1 + 2^-30 is 1 in float32, and that difference would vanish.
    one, just_above = (dataclasses.replace(run_of(), losses=(loss,)) for loss in (1.0, 1.0 + 2.0 ** -30))
    finer = ec.compare(one, just_above, tolerance=Tolerance(rtol=0.0, atol=2.0 ** -31))
    assert finer.margin == 2.0 and finer.mismatches[0].kind == "loss"


def test_the_tolerance_follows_the_references_precision_mode_else_its_weights_dtype():
    float32 = dataclasses.replace(run_of(), precision="")  # no mode named: the weights' dtype decides
    assert ec.compare(float32, float32).tolerance == Tolerance.resolve(torch.float32)
    autocast = dataclasses.replace(run_of(), precision="bf16-autocast")  # float32 weights, bf16's tolerance
    assert ec.compare(autocast, autocast).tolerance == Tolerance.resolve(PRECISIONS["bf16-autocast"])
    with pytest.raises(ec.InvalidArgument,
                       match=r"^Expected an equivcheck.Tolerance but got tolerance=0.1 \(type=float\)$"):
        ec.compare(float32, float32, tolerance=0.1)


def test_a_tensor_within_tolerance_is_scanned_once_and_never_broken_down(monkeypatch):
    def breakdown(*args):
        raise AssertionError("the breakdown ran on a tensor within tolerance")

    monkeypatch.setattr(diff_module._Scan, "breakdown", breakdown)
    assert ec.compare(run_of(), run_of(grad=(2.625, 0.0)), tolerance=TOL).ok
    with pytest.raises(AssertionError, match="the breakdown ran"):  # the same pair one step past the bound
        ec.compare(run_of(), run_of(grad=(3.875, 0.0)), tolerance=TOL)


def reference_diff(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> TensorDiff:
    """torch.testing's figures from whole-tensor temporaries, as written before the comparison streamed: what
    every slice size must reproduce exactly."""
    abs_diff = (actual - expected).abs()
    allowed = tol.atol + tol.rtol * expected.abs()
    ratio = torch.where(abs_diff == 0, 0.0, torch.nan_to_num(abs_diff / allowed, nan=math.inf))
    rel_diff = torch.nan_to_num(abs_diff / expected.abs(), nan=0.0)
    rel_diff = torch.where(abs_diff.isnan(), math.inf, rel_diff)
    abs_at, rel_at = int(torch.nan_to_num(abs_diff, nan=math.inf).argmax()), int(rel_diff.argmax())
    index = lambda flat: tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape))  # noqa: E731
    return TensorDiff(int((ratio > 1).sum()), ratio.numel(), float(abs_diff.reshape(-1)[abs_at]), index(abs_at),
                      float(allowed.reshape(-1)[abs_at]), float(rel_diff.reshape(-1)[rel_at]), index(rel_at),
                      float(ratio.max()))


def same_figures(a: TensorDiff, b: TensorDiff) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 16])
def test_the_streamed_figures_are_exactly_the_whole_tensors_at_every_slice_size(monkeypatch, chunk):
    """Ties (the first index wins), NaNs and infinities, zeros expected, equal tensors, float32 and float64."""
    monkeypatch.setattr(diff_module, "CHUNK", chunk)
    generator = torch.Generator().manual_seed(chunk)
    for trial in range(300):
        dtype = (torch.float32, torch.float64)[trial % 2]
        shape = ((5,), (3, 4), (37,), (2, 3, 5), (130,))[trial % 5]
        expected = torch.randn(shape, generator=generator, dtype=dtype).round(decimals=trial % 3)
        actual = expected + torch.randn(shape, generator=generator, dtype=dtype) * (0, 1e-9, 1e-6, 1e-3, 1)[trial % 7 % 5]
        flat = actual.view(-1)
        if trial % 4 == 1:
            flat[trial % flat.numel()] = (math.nan, math.inf, -math.inf, 0.0)[trial % 8 // 2]
        if trial % 6 == 2:
            expected.view(-1)[trial % flat.numel()] = 0.0
        if trial % 10 == 3:  # every element tied
            actual.fill_(1.5), expected.fill_(1.0)
        tol = (Tolerance(1.3e-6, 1e-5), Tolerance(0.5, 0.25), Tolerance(1e-5, 1e-8))[trial % 3]
        assert same_figures(TensorDiff.of(actual, expected, tol), reference_diff(actual, expected, tol)), trial


def test_equal_elements_match_even_where_nothing_is_allowed():
    """atol=0 allows nothing at an expected 0: an actual 0 there is equal, not 0 / 0 beyond the bound."""
    expected, actual = torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.5])
    diff = TensorDiff.of(actual, expected, Tolerance(rtol=0.5, atol=0.0))
    assert (diff.mismatched, diff.margin) == (0, 0.5)
    assert TensorDiff.of(expected, expected.clone(), Tolerance(rtol=0.5, atol=0.0)).margin == 0.0


def test_a_gradient_series_names_its_first_step_beyond_the_bound_the_first_worst_and_every_steps_margin():
    steps = [(2.0, 2.0), (2.0, 3.25), (2.0, 3.875), (2.0, 3.875)]  # margins 0, 1 (within), 1.5, 1.5
    reference = dataclasses.replace(run_of(), grads=tuple({"w": torch.tensor((2.0, 2.0))} for _ in steps))
    candidate = dataclasses.replace(run_of(weight=2.5), grads=tuple({"w": torch.tensor(g)} for g in steps))
    comparison = ec.compare(reference, candidate, tolerance=TOL)
    grad, weight = comparison.mismatches
    assert (grad.kind, grad.first_step, grad.worst_step, grad.step_margins) == ("grad", 2, 2, (0.0, 1.0, 1.5, 1.5))
    assert (weight.kind, weight.first_step, weight.step_margins) == ("weight", None, ())
    assert (comparison.max_abs, comparison.max_rel, comparison.margin) == (1.875, 1.5, 2.0)


def test_a_nan_is_the_worst_difference_and_never_within_tolerance():
    """Runs with a NaN are errors before they are compared (training.ensure_finite); compare, called directly,
    still names a NaN as the greatest difference, not as a match."""
    diff = TensorDiff.of(torch.tensor([1.5, math.nan]), torch.tensor([1.0, 1.0]), TOL)
    assert (diff.mismatched, diff.abs_index, diff.margin) == (1, (1,), math.inf) and math.isnan(diff.max_abs)
    reference = dataclasses.replace(run_of(), losses=(2.0, 2.0))
    (mismatch,) = ec.compare(reference, dataclasses.replace(run_of(), losses=(2.0, math.nan)), tolerance=TOL).mismatches
    assert (mismatch.kind, mismatch.first_step, mismatch.step_margins) == ("loss", 1, (0.0, math.inf))
