"""DDP with a compressing comm hook (fp16, bf16, PowerSGD) and FSDP2 reducing in bf16, on the warm pool: each lossy
reduction passes at its own error bound, fails the same comparison at float64's tolerance (the compression
happened), and the per-rank mean-loss bug is still caught beside it at that bound."""

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.errors import InvalidArgument

CASE = "ddp_compressed_uneven_shards"
FP16, BF16 = "ddp_hook:world_size=2,hook=fp16", "ddp_hook:world_size=2,hook=bf16"
POWERSGD = "ddp_hook:world_size=2,hook=powersgd"
POWERSGD_FROM_STEP_2 = "ddp_hook:world_size=2,hook=powersgd,start_iter=2"
MEAN_LOSS = "ddp_hook_mean_loss:world_size=2,hook=fp16"
FSDP_BF16 = "fsdp:world_size=2,reduce_dtype=bf16"


@pytest.fixture(scope="module")
def report():
    return ec.check(CASE, measure_memory=False)


def test_the_case_is_as_declared(report):
    report.assert_equivalent()
    assert [o.regime for o in report.outcomes] == ["full_batch", "ddp:world_size=2", FP16, MEAN_LOSS, BF16, POWERSGD,
                                                   POWERSGD_FROM_STEP_2, FSDP_BF16]


@pytest.mark.parametrize(("spec", "hook", "rtol"), [(FP16, "fp16_compress_hook", 3 * 2**-11),
                                                    (BF16, "bf16_compress_hook", 3 * 2**-8)])
def test_a_lossy_hook_passes_at_its_own_bound_and_says_which(report, spec, hook, rtol):
    outcome = report.outcome(CASE, spec)
    tolerance = outcome.comparison.tolerance
    # float64's own tolerance plus (W + 1) roundings of the wire type's unit roundoff, W = 2 ranks
    assert tolerance.rtol == pytest.approx(1e-7 + rtol) and tolerance.atol >= rtol
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 0.5, outcome.comparison
    assert hook in tolerance.source and f"compared at rtol={tolerance.rtol:g}" in outcome.reason
    assert f"margin {outcome.comparison.margin:.3g}" in outcome.reason  # the measured error, as for every regime
    assert outcome.result.syncs == (1, 1, 1)  # counted through the hook: DDP takes one comm hook per wrapper
    # the bytes of the bucket as DDP hands it to the hook (6-10-3 MLP: 103 float64s, before compression), as ddp's
    assert outcome.result.sync_bytes == report.outcome(CASE, "ddp:world_size=2").result.sync_bytes == (8 * 103,) * 3
    # what went over the wire: the bucket cast to the 16-bit type, 2 bytes per gradient
    assert outcome.result.collectives == ({"all_reduce": (1, 2 * 103)},) * 3


def test_fsdp2_reducing_in_bf16_passes_at_the_same_bound_and_its_mean_loss_bug_is_caught(report, locating):
    """FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.bfloat16): the reduce-scatter's roundings are ddp_hook's, so
    is the bound; the per-rank mean loss (shards of 4 and 3 averaged equally) stays caught under it."""
    outcome = report.outcome(CASE, FSDP_BF16)
    tolerance = outcome.comparison.tolerance
    assert tolerance.rtol == pytest.approx(1e-7 + 3 * 2**-8) and "FSDP2's reduce-scatter in bf16" in tolerance.source
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    (fault,) = ec.check(CASE, ["fsdp_mean_loss:world_size=2,reduce_dtype=bf16"], measure_memory=False).outcomes
    assert fault.verdict is Verdict.EXPECTED_MISMATCH and fault.comparison.tolerance == tolerance, fault.describe()
    assert fault.comparison.location is not None and fault.comparison.location.phase == "loss", fault.describe()


def test_fsdp_names_the_reduce_dtypes_it_takes():
    with pytest.raises(InvalidArgument, match=r"reduce_dtype='float8' is not allowed: expected one of bf16, fp16"):
        ec.check(CASE, ["fsdp:world_size=2,reduce_dtype=float8"])


@pytest.mark.parametrize("spec", [FP16, BF16, FSDP_BF16])
def test_twin_the_same_comparison_fails_at_float64_tolerance(report, spec):
    """The bound is what admits it: the gradients really went through a 16-bit all-reduce."""
    reference = report.outcome(CASE, "full_batch").result
    strict = ec.compare(reference, report.outcome(CASE, spec).result)
    assert not strict.ok and strict.margin > 100 and strict.tolerance == ec.Tolerance(1e-7, 1e-7)
    assert report.outcome(CASE, "ddp:world_size=2").comparison.margin < 1e-4  # plain DDP: float64 rounding only


def test_a_tolerance_the_call_gives_holds_for_a_lossy_hook_too():
    outcome = ec.check(CASE, [FP16], rtol=1e-7, atol=1e-7, measure_memory=False).outcomes[0]
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.tolerance.source == ""


def test_bfloat16_compresses_coarser_than_float16(report):
    """Step 0's gradients, from the same weights: bfloat16 keeps 8 bits of significand, float16 11, so the median
    relative error is about 8 times float16's (measured: 2.4e-3 and 2.1e-4)."""
    reference = report.outcome(CASE, "full_batch").result.grads[0]

    def median_error(spec):
        grads = report.outcome(CASE, spec).result.grads[0]
        return float(torch.cat([((grads[n] - e).abs() / e.abs()).flatten() for n, e in reference.items()]).median())

    assert median_error(BF16) > 4 * median_error(FP16) and 2**-14 < median_error(FP16) < 2**-11
    assert median_error("ddp:world_size=2") < 1e-12


def test_pitfall_mean_loss_under_the_hook_is_caught_at_its_bound(report):
    """4 and 3 samples per rank averaged equally: caught at float16 compression's bound, not hidden by it."""
    outcome = report.outcome(CASE, MEAN_LOSS)
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin >= 10, outcome.comparison
    assert "fp16_compress_hook over 2 ranks" in outcome.reason


def test_powersgd_is_exact_before_it_starts_and_a_mismatch_from_its_first_compressed_step(report):
    if (why := ec.parse_regime(POWERSGD).unavailable()) is not None:
        assert report.outcome(CASE, POWERSGD).verdict is Verdict.SKIPPED
        pytest.skip(why)
    plain = report.outcome(CASE, POWERSGD)
    assert plain.verdict is Verdict.EQUIVALENT and plain.comparison.margin < 1e-4
    assert plain.comparison.tolerance == ec.Tolerance(1e-7, 1e-7, plain.comparison.tolerance.source)
    assert "not bounded element-wise" in plain.reason and "plain all-reduce before step 1000" in plain.reason
    compressed = report.outcome(CASE, POWERSGD_FROM_STEP_2)
    assert compressed.verdict is Verdict.EXPECTED_MISMATCH and compressed.comparison.margin > 1e4
    assert compressed.comparison.first_divergent_step == 2  # steps 0 and 1 all-reduce plainly, exactly
    assert "compressing from step 2" in compressed.reason and compressed.result.syncs == (1, 1, 1)
    # the traffic tells it too: the whole bucket all-reduced plainly, then from step 2 several smaller all-reduces
    # (PowerSGD's uncompressed vectors, its P and Q factors) that add up to less than the bucket
    traffic = [step["all_reduce"] for step in compressed.result.collectives]
    assert traffic[:2] == [(1, 8 * 103)] * 2 and traffic[2][0] > 1 and traffic[2][1] < 8 * 103, traffic


def test_hook_specs_parse_print_back_and_name_their_hook():
    regime = ec.parse_regime("ddp_hook:hook=powersgd,world_size=2,approximation_rank=2,start_iter=5")
    assert str(regime) == "ddp_hook:world_size=2,hook=powersgd,approximation_rank=2,start_iter=5"
    assert ec.parse_regime(str(regime)) == regime
    assert str(ec.parse_regime("ddp_hook:world_size=2,hook=fp16")) == FP16  # the hook is always in the spec


@pytest.mark.parametrize(("spec", "message"), [
    ("ddp_hook:world_size=2", "ddp_hook needs hook (e.g. 'ddp_hook:hook=fp16')"),
    ("ddp_hook:world_size=2,hook=int8", "hook='int8' is not allowed: expected one of fp16, bf16, powersgd"),
    ("ddp_hook:world_size=2,hook=fp16,start_iter=5",
     "start_iter=5 is not allowed: expected 1000 (the default) with hook=fp16: only hook=powersgd takes it"),
    ("ddp_hook:world_size=2,hook=bf16,approximation_rank=2", "approximation_rank=2 is not allowed"),
    ("ddp_hook:world_size=2,hook=powersgd,start_iter=1", "start_iter=1 is not allowed: expected an integer >= 2"),
    ("ddp_hook:world_size=2,hook=powersgd,approximation_rank=0", "approximation_rank=0 is not allowed"),
])
def test_bad_hook_options_are_usage_errors(spec, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        ec.parse_regime(spec)


def test_powersgd_on_cpu_ranks_beside_a_gpu_is_skipped_quoting_torch(monkeypatch):
    """torch's hook synchronises CUDA on a CPU gradient's device wherever CUDA exists (an error on a GPU machine's gloo
    ranks, measured on an H200): such a row is skipped saying why, not an error; without a GPU it runs."""
    from equivcheck.regimes import ddp_hooks

    powersgd, fp16 = ec.parse_regime(POWERSGD_FROM_STEP_2), ec.parse_regime(FP16)
    monkeypatch.setattr(ddp_hooks, "gpus", lambda: 1)
    assert "torch.cuda.synchronize(device)" in powersgd.unavailable("cpu") and fp16.unavailable("cpu") is None
    monkeypatch.setattr(ddp_hooks, "gpus", lambda: 0)
    assert powersgd.unavailable("cpu") is None

