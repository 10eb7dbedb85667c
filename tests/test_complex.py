"""Complex parameters and buffers: trained complex in every precision mode, and compared part by part."""

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.judge import witness
from equivcheck.diff import TensorDiff
from equivcheck.precision import Tolerance
from equivcheck.judge.rounding import _noise_margin

COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}


class ComplexWeight(nn.Module):
    """A linear layer beside a complex one, read through its modulus: both parts of ``c`` shape the loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.c = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))

    def forward(self, x):
        return self.lin(x) + (x.to(self.c.dtype) @ self.c.T).abs()


class Rotary(nn.Module):
    """Llama's rotary embedding: a complex64 ``freqs_cis`` buffer turns pairs of features, as complex numbers."""

    def __init__(self, tokens=5, dim=6):
        super().__init__()
        self.tokens, self.dim = tokens, dim
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(tokens * dim, 2)
        angles = torch.outer(torch.arange(tokens, dtype=torch.float32),
                             1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        h = self.proj(x.view(-1, self.tokens, self.dim))
        turned = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2)) * self.freqs_cis
        return self.head(torch.view_as_real(turned).type_as(h).flatten(1))


def squared_error(output, target):
    return F.mse_loss(output, target, reduction="none").mean(dim=1)


def complex_case(dtype):
    return ec.Case(name=f"complex_weight_{str(dtype)[6:]}", model=ComplexWeight,
                   data=lambda: (torch.randn(36, 3), torch.randn(36, 4)), loss=squared_error, batch_size=12, steps=3,
                   dtype=dtype)


def rotary_case(dtype):
    return ec.Case(name=f"rotary_{str(dtype)[6:]}", model=Rotary,
                   data=lambda: (torch.randn(24, 30), torch.randn(24, 2)), loss=squared_error, batch_size=8, steps=3,
                   dtype=dtype)


@pytest.fixture
def no_casting_warning():
    """Any warning is an error: torch warns when it casts a complex tensor to a real dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_parameter_stays_complex_and_accumulates_equivalently(dtype, no_casting_warning):
    case = complex_case(dtype)
    reference = ec.run(case, "full_batch")
    assert reference.weights["c"].dtype == COMPLEX_OF[dtype]
    assert reference.weights["lin.weight"].dtype == dtype
    assert all(step["c"].dtype == COMPLEX_OF[dtype] for step in reference.grads)
    assert reference.weights["c"].imag.abs().max() > 0.1  # the imaginary part was kept, and trained
    for outcome in ec.check(case, ["accumulate:chunks=4", "accumulate:chunks=5"]).outcomes:  # 3 each; 3, 3, 2, 2, 2
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.comparison.describe()
        assert 0 < outcome.comparison.margin < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uneven_naive_accumulation_mismatches_on_the_complex_parameter(dtype, no_casting_warning):
    (outcome,) = ec.check(complex_case(dtype), ["naive_accumulate:chunks=5"]).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    mismatched = {(m.kind, m.name) for m in outcome.comparison.mismatches}
    assert {("grad", "c"), ("weight", "c"), ("grad", "lin.weight")} <= mismatched
    grad = next(m for m in outcome.comparison.mismatches if (m.kind, m.name) == ("grad", "c"))
    assert grad.first_step == 0 and grad.diff.complex_parts and grad.diff.total == 2 * 12
    assert "grad of 'c' mismatched from step 0" in outcome.comparison.describe()


def test_clipping_takes_the_norm_of_complex_gradients(no_casting_warning):
    (outcome,) = ec.check(complex_case(torch.float32), ["accumulate:chunks=5,max_norm=0.5"],
                          reference="full_batch:max_norm=0.5").outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert "accumulate:chunks=5,max_norm=0.5: clipping engaged at 3 of 3 steps" in outcome.describe()


def test_a_change_to_the_imaginary_part_alone_is_found_and_located():
    reference = ec.run(complex_case(torch.float64), "full_batch")
    grads = [dict(step) for step in reference.grads]
    grads[1]["c"] = grads[1]["c"].clone()
    grads[1]["c"][2, 1] += 1e-4j
    cmp = ec.compare(reference, dataclasses.replace(reference, grads=tuple(grads)))
    (mismatch,) = cmp.mismatches
    assert (mismatch.kind, mismatch.name, mismatch.first_step) == ("grad", "c", 1)
    assert mismatch.diff.mismatched == 1 and mismatch.diff.abs_index == (2, 1, 1)
    assert mismatch.diff.max_abs == pytest.approx(1e-4, rel=1e-6)
    assert "Greatest absolute difference: 0.0001 in the imaginary part at index (2, 1)" in cmp.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_rotary_buffer_stays_complex_and_accumulates_equivalently(dtype, no_casting_warning):
    case = rotary_case(dtype)
    reference = ec.run(case, "full_batch")
    freqs = reference.buffers["freqs_cis"]
    assert freqs.dtype == COMPLEX_OF[dtype]
    assert freqs.imag.abs().max() > 0.5  # the rotation kept its sines
    torch.testing.assert_close(freqs.abs(), torch.ones(5, 3, dtype=freqs.real.dtype), rtol=0, atol=1e-6)
    (outcome,) = ec.check(case, ["accumulate:chunks=3"]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.comparison.describe()


TOL = Tolerance(rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_tensors_differing_only_in_their_imaginary_parts_mismatch(dtype):
    expected = torch.tensor([[1 + 2j, -3 + 0.5j], [0.25 - 1j, 4 + 4j]], dtype=dtype)
    actual = expected.clone()
    actual[1, 0] += 1e-3j
    assert TensorDiff.of(expected.clone(), expected, TOL).margin == 0
    assert TensorDiff.of(expected.clone(), expected, TOL).mismatched == 0
    diff = TensorDiff.of(actual, expected, TOL)
    assert diff.complex_parts and (diff.mismatched, diff.total) == (1, 8)
    assert diff.abs_index == (1, 0, 1) and diff.max_abs == pytest.approx(1e-3, rel=1e-4)
    assert diff.abs_allowed == pytest.approx(1e-7 + 1e-7 * 1.0)  # the imaginary part's own scale: |-1|
    assert diff.margin == pytest.approx(1e-3 / 2e-7, rel=1e-4)


def test_a_complex_tensor_beyond_one_slice_is_streamed_and_located():
    expected = torch.randn(300, 400, dtype=torch.complex64)  # 240,000 parts: four slices of CHUNK
    actual = expected.clone()
    actual[250, 7] += 1j
    actual[10, 3] += 1e-6 * (1 + 1j)
    diff = TensorDiff.of(actual, expected, Tolerance(rtol=1.3e-6, atol=1e-5))
    assert (diff.mismatched, diff.total, diff.abs_index) == (1, 240_000, (250, 7, 1))
    assert diff.max_abs == pytest.approx(1.0, rel=1e-5)
    actual[250, 7] -= 1j
    within = TensorDiff.of(actual, expected, Tolerance(rtol=1.3e-6, atol=1e-5))
    assert within.mismatched == 0 and within.abs_index[:2] == (10, 3) and 0 < within.margin < 1


def test_complex_parts_are_judged_each_at_its_own_scale_within_tolerance():
    expected = torch.tensor([1e3 + 1j, -2 - 5e2j], dtype=torch.complex128)
    actual = expected + torch.tensor([1e-5 + 0j, 0 - 2e-5j], dtype=torch.complex128)
    diff = TensorDiff.of(actual, expected, TOL)
    assert diff.mismatched == 0 and 0 < diff.margin < 1
    assert diff.abs_index == (1, 1) and diff.max_abs == pytest.approx(2e-5, rel=1e-6)
    nudged = actual.clone()
    nudged[0] += 1e-6j  # within 1e-7 * |1e3 + 1j| of the modulus, but 5 times the imaginary part's own allowance
    assert TensorDiff.of(nudged, expected, TOL).mismatched == 1


def test_a_real_candidate_of_a_complex_reference_differs_by_the_imaginary_parts():
    expected = torch.tensor([1 + 1j, 2 + 0j], dtype=torch.complex128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diff = TensorDiff.of(expected.real.clone(), expected, TOL)
    assert (diff.mismatched, diff.abs_index, diff.max_abs) == (1, (0, 1), 1.0)


def test_rounding_weighs_a_complex_quantity_part_by_part():
    """The float64 shadows' noise on a complex gradient: an imaginary part the regime moved counts, not dropped."""
    def run(grad):
        return SimpleNamespace(grads=({"c": torch.tensor([grad], dtype=torch.complex128)},), weights={}, buffers={},
                               losses=(None,))

    reference, regime = run(2 + 0j), run(2 + 3j)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # |3 - 0| / (0.25 + 0.5 * |0|): the imaginary part at its own scale
        assert _noise_margin(reference, regime, reference, regime, Tolerance(rtol=0.5, atol=0.25)) == (12.0, 0.0, 0.0)
        # the regime strays 1 from its shadow in the imaginary part: allowed 0.25 + 1
        assert _noise_margin(reference, regime, reference, run(2 + 2j), Tolerance(rtol=0.5, atol=0.25))[0] == 2.4


def complex_runs(candidate_imag):
    """A reference, its witness and a candidate on one complex weight whose imaginary gradient is at rounding level:
    rounding moved the reference's imaginary parts by 1e-3 from where they started, the witness's by -1e-3."""
    base = ec.run(complex_case(torch.float64), "full_batch")
    start = torch.tensor([0.5 + 0.5j, -1.0 + 0.25j], dtype=torch.complex128)

    def result(grad_imag, moved):
        grads = ({"c": torch.complex(torch.tensor([1.0, -2.0], dtype=torch.float64), grad_imag)},)
        return dataclasses.replace(base, grads=grads, weights={"c": start + 1j * moved}, buffers={}, losses=(1.0,))

    noise = torch.tensor([1e-18, -3e-18], dtype=torch.float64)
    return (result(noise, torch.full((2,), 1e-3, dtype=torch.float64)), result(-noise, torch.full((2,), -1e-3)),
            result(noise, torch.full((2,), candidate_imag, dtype=torch.float64)), start)


@pytest.mark.parametrize("candidate_imag, explained", [(2e-3, True), (5e-3, False)])
def test_the_witness_judges_the_imaginary_parts_that_rounding_drives(candidate_imag, explained, no_casting_warning):
    reference, witnessed, candidate, start = complex_runs(candidate_imag)
    table = ec.compare(reference, candidate)
    assert [(m.kind, m.name) for m in table.mismatches] == [("weight", "c")]
    assert table.mismatches[0].diff.abs_index == (0, 1)  # the first imaginary part
    assert witness.applies(table, reference, candidate)
    judged = witness.judge(table, reference, candidate, lambda orders: [witnessed], lambda: {"c": start}, lambda: "a test")
    assert judged.ok is explained
    if explained:
        assert "weight of 'c' (2 of 4 real and imaginary parts): true gradient zero" in judged.note
    else:
        assert judged.mismatches == table.mismatches
