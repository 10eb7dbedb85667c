"""torch.compile as a wrap on any regime: judged against the eager reference, and a compile that compiled nothing is
an error, never an eager run called compiled."""

from __future__ import annotations

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.regimes import compiled
from equivcheck.regimes.ddp import Ddp
from equivcheck.strategies import CaseSpec


def test_fsdp2_compiled_is_equivalent_and_a_pitfall_under_compile_is_caught():
    report = ec.check("tokens", ["fsdp:world_size=2,compile=aot_eager", "naive_accumulate:chunks=4,compile=aot_eager"])
    faithful, pitfall = report.outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()
    assert pitfall.verdict is Verdict.MISMATCH and pitfall.comparison.margin > 1000


def test_a_compile_that_compiled_nothing_is_an_error_not_an_eager_run():
    """A pipeline's stages call the model's parts, never the module torch.compile wrapped: the run was eager."""
    (outcome,) = ec.check("tokens", ["pipeline:stages=2,microbatches=4,compile=aot_eager"]).outcomes
    assert outcome.verdict is Verdict.ERROR and "compiled nothing" in outcome.reason, outcome.describe()


def test_the_option_makes_the_regime_a_compiled_one_of_its_own_class():
    regime = ec.parse_regime("ddp:world_size=2,compile=inductor")
    assert isinstance(regime, Ddp) and regime.world_size == 2 and regime.compile == "inductor"
    assert str(regime) == "ddp:world_size=2,compile=inductor" and ec.parse_regime(str(regime)) == regime
    naive = ec.parse_regime("naive_accumulate:chunks=4,compile=aot_eager")
    assert str(type(naive).pitfall.twin_of(naive)) == "accumulate:chunks=4,compile=aot_eager"
    both = ec.parse_regime("naive_accumulate:chunks=4,compile=aot_eager,compile_optimizer=1")
    assert str(type(both).pitfall.twin_of(both)) == "accumulate:chunks=4,compile=aot_eager,compile_optimizer=1"
    with pytest.raises(ec.InvalidArgument, match="compile='tvm' is not allowed: expected one of inductor, aot_eager"):
        ec.parse_regime("accumulate:chunks=2,compile=tvm")


def test_the_optimizers_step_compiled_too_is_equivalent_and_a_step_left_eager_is_an_error(monkeypatch):
    """torch.compile(optimizer.step), the recording's hooks inside it: equivalent in process and on DDP ranks. A step
    that never went through torch.compile is an error, never an eager step called compiled."""
    specs = ["accumulate:chunks=2,compile=aot_eager,compile_optimizer=1",
             "ddp:world_size=2,compile=aot_eager,compile_optimizer=1"]
    for outcome in ec.check("compiled_tokens", specs).outcomes:
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    monkeypatch.setattr(compiled, "compile_step", lambda optimizer, model, backend: optimizer)
    (eager,) = ec.check("compiled_tokens", specs[:1]).outcomes
    assert eager.verdict is Verdict.ERROR and "compiled no optimizer step" in eager.reason, eager.describe()


def test_inductor_without_a_compiler_is_skipped_saying_so(monkeypatch):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    (outcome,) = ec.check("tokens", ["accumulate:chunks=2,compile=inductor"]).outcomes
    assert outcome.verdict is Verdict.SKIPPED and "no C++ compiler is here" in outcome.reason
    assert ec.parse_regime("accumulate:chunks=2,compile=aot_eager").unavailable() is None


def test_a_teams_fsdp2_with_each_block_compiled_in_its_place_is_judged_by_the_cases_names():
    """torchtitan's way: torch.compile(block) registered where the block was, then fully_shard. The same parameters
    under '_orig_mod.' names: equivalent (before the names were read as the case's: 'weight names differ' with every
    number matching), and a scaling bug under the same compile is caught."""
    import compiled_blocks

    faithful = ec.check_step("mlp", compiled_blocks.step, mesh={"dp": 2}, parallelize=compiled_blocks.parallelize)
    assert faithful.outcomes[0].verdict is Verdict.EQUIVALENT, faithful.outcomes[0].describe()
    scaled = ec.check_step("mlp", compiled_blocks.step_scaled_by_world, mesh={"dp": 2},
                           parallelize=compiled_blocks.parallelize)
    assert scaled.outcomes[0].verdict is Verdict.MISMATCH and scaled.outcomes[0].comparison.margin > 1000


@pytest.mark.full_only  # 10 s of compiling: make test-full
def test_compiled_autograd_traces_the_backward_too_and_a_backward_left_eager_is_an_error(monkeypatch):
    import contextlib

    from torch._dynamo import compiled_autograd

    spec = "accumulate:chunks=2,compile=aot_eager,compiled_autograd=1"
    (outcome,) = ec.check("tokens", [spec]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    monkeypatch.setattr(compiled_autograd, "_enable", lambda compiler: contextlib.nullcontext())
    (eager,) = ec.check("tokens", [spec]).outcomes
    assert eager.verdict is Verdict.ERROR and "captured no backward" in eager.reason, eager.describe()
    (ranks,) = ec.check("tokens", ["ddp:world_size=2,compile=aot_eager,compiled_autograd=1"]).outcomes
    assert ranks.verdict is Verdict.SKIPPED and "python_reducer" in ranks.reason


@pytest.mark.full_only  # 45 s of inductor compiling: make test-full
def test_inductor_draws_dropouts_masks_as_the_eager_reference_does(monkeypatch):
    """One dropout layer in process under inductor: equivalent. Inductor's own generator (fallback_random off, as a
    helper measured) drew other masks: a mismatch from step 0, a false alarm."""
    spec = "accumulate:chunks=2,compile=inductor"
    (outcome,) = ec.check("dropout_one_layer", [spec]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    monkeypatch.setattr(compiled, "INDUCTOR_SETTINGS", {})
    import torch._dynamo

    torch._dynamo.reset()  # the graphs compiled above drew eager's masks: compile again, with inductor's own
    (own_masks,) = ec.check("dropout_one_layer", [spec]).outcomes
    assert own_masks.verdict is Verdict.MISMATCH and own_masks.comparison.first_divergent_step == 0


# A drawn attention LM on which a graph compiled for accumulation, served again by dynamo's cache, had given its
# saved buffers away: retained_graph's second backward over it raised (bench_false_alarms.py --compiled, seed 3).
DONATING = ec.register_case(CaseSpec(
    widths=(4, 8), activation="gelu", dtype="float32", batch_size=2, steps=3, loss="cross_entropy",
    optimizer="momentum", lr=0.01, heads=4, block=2, attention_bias=True, tied=True).build())


@pytest.mark.full_only  # 18 s of compiling twice: make test-full
def test_a_graph_compiled_for_another_regime_serves_a_retained_graph_one(monkeypatch):
    specs = ["accumulate:chunks=2,compile=aot_eager", "retained_graph:chunks=2,compile=aot_eager"]
    assert all(o.verdict is Verdict.EQUIVALENT for o in ec.check(DONATING, specs).outcomes)
    monkeypatch.setattr(compiled, "FUNCTORCH_SETTINGS", {})  # the buffers given away again
    import torch._dynamo

    torch._dynamo.reset()
    _, retained = ec.check(DONATING, specs).outcomes
    assert retained.verdict is Verdict.ERROR and "donated buffers" in retained.reason, retained.describe()


def test_a_step_under_torch_func_grad_is_told_how_to_leave_the_activation_meter_out():
    import team_functional

    (outcome,) = ec.check_step("mlp", team_functional.step).outcomes
    assert outcome.verdict is Verdict.ERROR and "measure_memory=False leaves it out" in outcome.reason
    (measured_not,) = ec.check_step("mlp", team_functional.step, measure_memory=False, compare_losses=False).outcomes
    assert measured_not.verdict is Verdict.EQUIVALENT, measured_not.describe()
