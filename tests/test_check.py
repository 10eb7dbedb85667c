"""check(): verdicts, their twins, and the guard against a nondeterministic reference."""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.judge.verdict import Status
from equivcheck.check import plan, plan_all
from equivcheck.runners.dispatch import Started
from equivcheck.judge.memory import MemoryUse


def test_faithful_accumulation_is_equivalent_and_its_buggy_twins_are_not():
    report = ec.check("mlp", ["accumulate:chunks=4", "step_per_micro_batch:chunks=4", "zero_grad_inside:chunks=4"])
    accumulate, stepped, zeroed = report.outcomes
    assert accumulate.verdict is Verdict.EQUIVALENT
    assert stepped.verdict is Verdict.MISMATCH
    assert "optimizer steps: the reference took 3, the candidate 12" in stepped.comparison.problems
    assert zeroed.verdict is Verdict.MISMATCH
    assert zeroed.comparison.first_divergent_step == 0 and zeroed.comparison.margin > 100
    assert not report.ok
    with pytest.raises(ec.NotEquivalent) as raised:
        report.assert_equivalent()
    message = str(raised.value)
    assert "2 of 3 checks failed" in message
    assert "mlp under zero_grad_inside:chunks=4: mismatch" in message
    assert "grad of '0.weight' mismatched from step 0" in message
    assert isinstance(raised.value, AssertionError)


def test_a_declared_pitfall_that_matches_is_a_failure():
    case = dataclasses.replace(ec.get_case("mlp"), name="mlp_wrongly_declared",
                               expect_mismatch={"accumulate": "declared by mistake"})
    (outcome,) = ec.check(case, ["accumulate:chunks=3"]).outcomes
    assert outcome.verdict is Verdict.UNEXPECTED_MATCH and outcome.reason == "declared by mistake"
    with pytest.raises(ec.NotEquivalent, match="unexpected_match"):
        ec.check(case, ["accumulate:chunks=3"]).assert_equivalent()


def test_naive_scaling_with_even_chunks_and_sample_counts_is_exact():
    """The pitfall needs uneven chunks: with 4 chunks of 3 samples mean / K is right, and equivcheck says so."""
    (outcome,) = ec.check("mlp", ["naive_accumulate:chunks=4"]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT


def test_nondeterministic_reference_is_reported_as_such():
    draws = itertools.count()
    base = ec.get_case("mlp")

    def drifting_data():  # a data pipeline with hidden state: different data on every call
        inputs, targets = base.data()
        return inputs + next(draws), targets

    case = dataclasses.replace(base, name="drifting", data=drifting_data)
    report = ec.check(case, ["full_batch", "accumulate:chunks=4"])
    assert [o.verdict for o in report.outcomes] == [Verdict.NONDETERMINISTIC] * 2
    assert "disagrees with itself" in report.outcomes[0].reason
    assert not report.ok


class FailsOnSmallBatches(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        if len(x) < 12:
            raise RuntimeError("this model needs the whole batch")
        return self.linear(x)


def test_a_crashing_regime_becomes_an_error_verdict_and_the_rest_still_runs():
    case = dataclasses.replace(ec.get_case("mlp"), name="fragile", model=FailsOnSmallBatches, split=None)
    report = ec.check(case, ["accumulate:chunks=2", "retained_graph:chunks=2"])
    crashed, fine = report.outcomes
    assert crashed.verdict is Verdict.ERROR
    assert crashed.reason == "RuntimeError: this model needs the whole batch"
    assert "Traceback" in crashed.details
    assert fine.verdict is Verdict.EQUIVALENT


def test_runs_are_reproducible_and_leave_the_callers_rng_alone():
    torch.manual_seed(1234)
    before = torch.rand(3)
    torch.manual_seed(1234)
    first = ec.run("gru_decoder", "accumulate:chunks=3")
    second = ec.run("gru_decoder", "accumulate:chunks=3")
    assert torch.equal(torch.rand(3), before)
    assert first.losses == second.losses
    for name in first.weights:
        assert torch.equal(first.weights[name], second.weights[name])
    other_seed = ec.run("gru_decoder", "accumulate:chunks=3", seed=1)
    assert other_seed.losses != first.losses


def test_case_tolerance_and_call_override():
    loose = dataclasses.replace(ec.get_case("naive_scaling_uneven_chunks"), name="loose", rtol=1.0, atol=1.0)
    (outcome,) = ec.check(loose, ["naive_accumulate:chunks=5"]).outcomes
    assert outcome.verdict is Verdict.UNEXPECTED_MATCH  # a tolerance that wide hides the pitfall
    (outcome,) = ec.check(loose, ["naive_accumulate:chunks=5"], rtol=1e-7, atol=1e-7).outcomes
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH


def test_float32_case_uses_float32_tolerance():
    case = dataclasses.replace(ec.get_case("mlp"), name="mlp32", dtype=torch.float32)
    report = ec.check(case, ["accumulate:chunks=5", "naive_accumulate:chunks=5"])
    assert report.outcomes[0].comparison.tolerance == ec.Tolerance(1.3e-6, 1e-5)
    assert report.outcomes[0].result.weights["0.weight"].dtype == torch.float32
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT, Verdict.MISMATCH]


def test_register_case_as_decorator_and_duplicate_names():
    @ec.register_case
    def tiny_case():
        return dataclasses.replace(ec.get_case("mlp"), name="tiny_registered")

    assert ec.get_case("tiny_registered").batch_size == 12
    assert callable(tiny_case)
    with pytest.raises(ec.InvalidArgument, match="name='mlp'"):
        ec.register_case(dataclasses.replace(ec.get_case("mlp")))


def test_check_can_leave_memory_unmeasured():
    """Memory measuring is a flag: off, the verdict is the same and no peak is recorded."""
    measured = ec.check("mlp", ["accumulate:chunks=4"])
    bare = ec.check("mlp", ["accumulate:chunks=4"], measure_memory=False)
    (with_memory,), (without,) = measured.outcomes, bare.outcomes
    assert with_memory.verdict is without.verdict is ec.Verdict.EQUIVALENT
    assert with_memory.result.peak_activation_bytes > 0
    assert without.result.peak_activation_bytes is None and without.memory.ratio is None


def test_a_report_of_skips_alone_checked_nothing():
    assert Status.of([Verdict.SKIPPED, Verdict.SKIPPED]) is Status.of([]) is Status.NOTHING_CHECKED
    assert Status.of([Verdict.SKIPPED, Verdict.EQUIVALENT]) is Status.OK


def test_plan_all_plans_every_registered_case_and_each_its_own_regimes_unless_named():
    plans = plan_all(None, ["full_batch"], rtol=0.5, atol=0.25)
    assert [p.case.name for p in plans] == list(ec.all_cases())
    assert all((p.rtol, p.atol, [str(s) for s in p.specs]) == (0.5, 0.25, ["full_batch"]) for p in plans)
    (mlp,) = plan_all(["mlp"])
    assert mlp.specs == plan("mlp").specs and len(mlp.specs) > 1


def test_check_all_checks_each_case_in_turn_and_measures_memory_unless_told_not_to():
    report = ec.check_all(["mlp", "seed004_linear"], ["accumulate:chunks=2"], measure_memory=False)
    assert [(o.case, o.verdict) for o in report.outcomes] == [("mlp", Verdict.EQUIVALENT),
                                                              ("seed004_linear", Verdict.EQUIVALENT)]
    assert all(o.memory.peak_bytes is None for o in report.outcomes)
    (measured,) = ec.check_all(["mlp"], ["accumulate:chunks=2"], rtol=0.5, atol=0.25).outcomes
    assert 0 < measured.memory.peak_bytes < measured.memory.reference_bytes
    assert measured.comparison.tolerance == ec.Tolerance(rtol=0.5, atol=0.25)  # the options reach every plan


def test_a_run_is_abandoned_once_and_never_after_its_result_was_read():
    calls = []
    started = Started(lambda: "result", lambda: calls.append("abandoned"))
    started.abandon()
    started.abandon()
    assert calls == ["abandoned"] and started.done
    finished = Started(lambda: "result", lambda: calls.append("too late"))
    assert finished.result() == "result"
    finished.abandon()
    assert calls == ["abandoned"]


def test_an_outcome_not_in_the_report_is_a_named_error_listing_the_ones_that_are():
    report = ec.check("mlp", ["accumulate:chunks=2"], compare_losses=False)
    with pytest.raises(ec.InvalidArgument) as raised:
        report.outcome("mlp", "full_batch")
    assert str(raised.value) == "unknown outcome 'mlp under full_batch'; known outcomes: mlp under accumulate:chunks=2"
    # compare_losses=False: every run's losses left out, the gradients and weights still compared
    assert report.outcome("mlp", "accumulate:chunks=2").result.losses == (None, None, None)
    assert (report + report).outcomes == report.outcomes * 2


def test_memory_not_saved_names_every_run_over_the_ratio_or_unmeasured():
    def outcome(case, verdict, memory):
        return ec.Outcome(case, "accumulate:chunks=2", verdict, memory=memory)

    report = ec.Report((
        outcome("a", Verdict.EQUIVALENT, MemoryUse(1024, 2048, "saved_tensors", True)),  # 0.5x: saves
        outcome("b", Verdict.EQUIVALENT, MemoryUse(2048, 2048, "saved_tensors", True)),  # 1x: saves nothing
        outcome("c", Verdict.SKIPPED, None),
    ))
    report.assert_saves_memory("accumulate:chunks=2", 0.5, case="a")
    with pytest.raises(ec.MemoryNotSaved) as raised:
        report.assert_saves_memory("accumulate:chunks=2", 0.5)
    assert str(raised.value) == (
        "2 of 3 runs of accumulate:chunks=2 peak above 0.5x the reference's activation memory:\n"
        f"b under accumulate:chunks=2: {report.outcomes[1].memory.describe()}\n"
        "c under accumulate:chunks=2: not measured (skipped)")


def test_the_gate_fails_a_communication_verdict_unless_told_to_allow_it_and_never_a_mismatch():
    def outcome(regime, verdict):
        return ec.Outcome("mlp", regime, verdict, reason=verdict.value)

    communication = ec.Report((outcome("ddp_sync_every_micro_batch:world_size=2,chunks=3", Verdict.COMMUNICATION),
                               outcome("accumulate:chunks=2", Verdict.EQUIVALENT)))
    with pytest.raises(ec.NotEquivalent) as raised:
        communication.assert_equivalent()
    first = communication.outcomes[0]
    assert str(raised.value) == f"{first.headline()}\n\n1 of 2 checks failed:\n\n{first.describe()}"
    communication.assert_equivalent(allow_communication=True)
    both = communication + ec.Report((outcome("naive_accumulate:chunks=5", Verdict.MISMATCH),))
    with pytest.raises(ec.NotEquivalent) as raised:
        both.assert_equivalent(allow_communication=True)
    mismatch = both.outcomes[2]
    assert str(raised.value) == f"{mismatch.headline()}\n\n1 of 3 checks failed:\n\n{mismatch.describe()}"
    with pytest.raises(ec.NotEquivalent) as raised:
        both.assert_equivalent()
    lines = str(raised.value).splitlines()
    assert lines[0].endswith(": communication (communication)") and lines[1].endswith(": mismatch (mismatch)")
    assert lines[3] == "2 of 3 checks failed:" and "\n\nmlp under naive" in str(raised.value)


def test_only_communication_problems_make_a_communication_verdict_and_only_gradients_a_note():
    from equivcheck.judge.verdict import _failed, _only_gradients
    from equivcheck.diff import Comparison, Mismatch, Problem, ProblemKind, TensorDiff

    tol = ec.Tolerance(rtol=0.5, atol=0.25)
    text = "communication: step 0 all-reduced gradients 3 time(s), expected 1"
    counted = Problem(ProblemKind.COMMUNICATION, text)
    steps = Problem(ProblemKind.STEPS, "optimizer steps: 3 vs 1")
    diff = TensorDiff(1, 1, 3.0, (), 1.25, 1.5, (), 2.4)
    grad, weight = Mismatch("grad", "w", 0, 0, diff), Mismatch("weight", "w", None, None, diff)
    assert _failed(Comparison(tol, (), (counted,), 0.0, 0.0, 0.0)) is Verdict.COMMUNICATION
    assert _failed(Comparison(tol, (), (counted, steps), 0.0, 0.0, 0.0)) is Verdict.MISMATCH
    # The verdict reads the problem's kind, never its words: text that merely reads like a count is a mismatch.
    assert _failed(Comparison(tol, (), (text,), 0.0, 0.0, 0.0)) is Verdict.MISMATCH
    assert _failed(Comparison(tol, (grad,), (counted,), 3.0, 1.5, 2.4)) is Verdict.MISMATCH
    assert _only_gradients(Comparison(tol, (grad,), (), 3.0, 1.5, 2.4)) == (
        "only the gradients recorded at optimizer.step() differ; the final weights and the losses match (the "
        "optimizer absorbed the difference, as Adam does a constant scale, or the step changed the gradients after "
        "they were recorded)")
    assert _only_gradients(Comparison(tol, (grad, weight), (), 3.0, 1.5, 2.4)) == ""
    assert _only_gradients(Comparison(tol, (grad,), ("optimizer steps: 3 vs 1",), 3.0, 1.5, 2.4)) == ""
    assert _only_gradients(Comparison(tol, (), (), 0.0, 0.0, 0.0)) == ""


def test_the_default_regimes_leave_out_those_that_need_a_split_where_the_case_has_none():
    with_split = ec.get_case("mlp")
    assert with_split.split is not None and "detached_partial:chunks=5" in ec.regimes_for(with_split)
    without = ec.Case(name="no_split", model=lambda: nn.Linear(2, 2), data=lambda: (torch.randn(4, 2), torch.zeros(4)),
                      loss=lambda out, y: out.sum(dim=1), batch_size=2)
    assert ec.regimes_for(without) == tuple(s for s in ec.regimes_for(with_split) if not s.startswith("detached"))


def test_a_case_declares_a_pitfall_by_its_exact_spec_or_by_the_regimes_name():
    report = ec.check("gru_detached_hidden", ["per_token:detach=0", "per_token:detach=1"])  # declared by exact spec
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT, Verdict.EXPECTED_MISMATCH]
    assert report.outcomes[1].reason.startswith("seed 002: the hidden state detached")
    (by_name,) = ec.check("naive_scaling_uneven_chunks", ["naive_accumulate:chunks=7"]).outcomes  # by name
    assert by_name.verdict is Verdict.EXPECTED_MISMATCH


def test_distributed_runs_between_in_process_ones_each_start_once_ahead_and_all_match():
    """While an in-process run trains, the next distributed one starts on the pool: the next, never one already
    collected (starting that again would leave it in flight and the next distributed run could not start)."""
    specs = ["ddp:world_size=2", "accumulate:chunks=3", "ddp_no_sync:world_size=2,chunks=3", "sample_by_sample"]
    report = ec.check("mlp", specs)
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * 4, report.outcomes[2].describe()


class RaisesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        raise RuntimeError("broken forward")


def test_a_reference_that_raises_makes_every_outcome_an_error_naming_its_case_and_regime():
    case = ec.Case(name="broken_reference", model=RaisesInForward, batch_size=6, steps=2,
                   data=lambda: (torch.randn(12, 4), torch.randint(0, 3, (12,))),
                   loss=lambda output, target: nn.functional.cross_entropy(output, target, reduction="none"))
    report = ec.check(case, ["accumulate:chunks=2", "sample_by_sample"])
    assert [(o.case, o.regime, o.verdict) for o in report.outcomes] == [
        ("broken_reference", "accumulate:chunks=2", Verdict.ERROR), ("broken_reference", "sample_by_sample", Verdict.ERROR)]
    assert report.outcomes[1].reason == "the reference full_batch failed: RuntimeError: broken forward"


def test_a_checks_arguments_are_checked_once_then_trusted_to_the_run(monkeypatch):
    """The plan checks each regime against the case once; the runs it starts (here, in a forked child) take the
    request as checked. Before, the same regime was validated again in dispatch and again in training."""
    calls = []
    validate = ec.Regime.validate

    def counted(self, case):
        calls.append(str(self))
        return validate(self, case)

    monkeypatch.setattr(ec.Regime, "validate", counted)
    for isolate in (False, True):
        calls.clear()
        report = ec.check("mlp", ["accumulate:chunks=2", "retained_graph:chunks=3"], isolate=isolate)
        assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT, Verdict.EQUIVALENT]
        assert sorted(calls) == ["accumulate:chunks=2", "full_batch", "retained_graph:chunks=3"], calls
