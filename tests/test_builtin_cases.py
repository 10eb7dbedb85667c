"""Every built-in case under each of its regimes gives the verdict it declares.

Faithful regimes must be equivalent with orders of magnitude of headroom; the negative controls
must be caught with a wide margin, and the report must name the parameters that diverged.
"""

import pytest

import equivcheck as ec
from equivcheck import Verdict

CASES = list(ec.builtin_cases())


@pytest.fixture(scope="module")
def reports():
    return {}


def report_for(name, reports):
    if name not in reports:
        reports[name] = ec.check(name)
    return reports[name]


# make test leaves the compiled case's regimes (half a minute of compiling) to make test-full; tests/test_compiled.py
# holds compiled regimes on their own in make test.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full_only) if name == "compiled_tokens" else name
                                  for name in CASES])
def test_every_regime_as_declared(name, reports):
    report = report_for(name, reports)
    case = ec.get_case(name)
    assert [o.regime for o in report.outcomes] == [str(ec.parse_regime(r)) for r in ec.regimes_for(case)]
    report.assert_equivalent()
    for outcome in report.outcomes:
        if outcome.comparison is not None and outcome.comparison.tolerance.source:  # a lossy regime's own bound
            assert "compared at rtol=" in outcome.reason, outcome.describe()
            assert outcome.comparison.margin < 0.5 if outcome.verdict is Verdict.EQUIVALENT else (
                outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 10), outcome.describe()
        elif outcome.verdict is Verdict.EQUIVALENT:
            assert outcome.comparison.margin < 1e-4, outcome.describe()  # float64 reordering error is tiny
        elif outcome.verdict is Verdict.SKIPPED:  # only for hardware this machine lacks
            assert "CUDA" in outcome.reason and (outcome.regime.startswith(("data_parallel", "sync_batchnorm"))
                                                 or "nccl" in outcome.regime or "hook=powersgd" in outcome.regime)
        elif outcome.comparison is None:  # a declared trap that crashed, with its message
            assert outcome.verdict is Verdict.EXPECTED_MISMATCH and "it crashed: WorkerError" in outcome.reason
        else:
            assert outcome.verdict is Verdict.EXPECTED_MISMATCH
            # caught by a wide numeric margin, or by what it communicated (numbers right, all-reduces wrong)
            assert outcome.comparison.margin > 100 or outcome.comparison.problems, outcome.describe()


@pytest.mark.parametrize(
    ("name", "regime", "diverged"),
    [
        # Mean / K scales every micro-batch's gradient: every parameter is wrong from the first step.
        ("naive_scaling_uneven_chunks", "naive_accumulate:chunks=5", ["0.weight", "0.bias", "2.weight", "2.bias"]),
        ("naive_scaling_uneven_tokens", "naive_accumulate:chunks=4", ["0.weight", "1.weight", "1.bias", "3.weight", "3.bias"]),
        # BatchNorm's affine parameters and everything around them see other statistics.
        ("batchnorm_cnn", "accumulate:chunks=5", ["0.weight", "1.weight", "1.bias", "4.weight"]),
        ("batchnorm_cnn", "sample_by_sample", ["0.weight", "1.weight", "1.bias", "4.weight"]),
    ],
)
def test_negative_controls_name_the_diverged_parameters(name, regime, diverged, reports):
    outcome = report_for(name, reports).outcome(name, regime)
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH
    grads = {m.name: m for m in outcome.comparison.mismatches if m.kind == "grad"}
    assert set(diverged) <= set(grads)
    assert all(grads[p].first_step == 0 for p in diverged)
    assert outcome.comparison.first_divergent_step == 0
    assert {m.name for m in outcome.comparison.mismatches if m.kind == "weight"} >= set(diverged)


def test_batchnorm_running_statistics_are_compared(reports):
    outcome = report_for("batchnorm_cnn", reports).outcome("batchnorm_cnn", "accumulate:chunks=5")
    assert {"1.running_mean", "1.running_var"} <= {m.name for m in outcome.comparison.mismatches if m.kind == "buffer"}


def test_batchnorm_trunk_run_once_stays_exact(reports):
    """Regimes that run BatchNorm once on the global batch are exact: the check is not just 'BN => fail'."""
    report = report_for("batchnorm_cnn", reports)
    for regime in ("retained_graph:chunks=5", "detached_partial:chunks=5"):
        assert report.outcome("batchnorm_cnn", regime).verdict is Verdict.EQUIVALENT
