"""Precision modes: dtype=, autocast that really changes the arithmetic, GradScaler through every regime."""

import dataclasses

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.precision import PRECISIONS, Precision
from equivcheck.regimes import Chunked, backward_chunks

FLOAT32_SCALED = dataclasses.replace(PRECISIONS["float32"], name="float32-scaled", grad_scaler=True)


def test_dtype_picks_the_weights_dtype_and_the_tolerance():
    result = ec.run("mlp", "full_batch", dtype="float32")
    assert result.weights["0.weight"].dtype == torch.float32 and result.precision == "float32"
    (outcome,) = ec.check("mlp", ["accumulate:chunks=5"], dtype="bf16-autocast").outcomes
    assert outcome.comparison.tolerance == ec.Tolerance(1.6e-2, 2**-8)
    assert outcome.verdict is Verdict.EQUIVALENT


def test_bf16_autocast_really_computes_in_bfloat16():
    """If autocast were silently off, bf16 and float32 runs would agree to float32 rounding."""
    bf16, fp32 = ec.run("mlp", "full_batch", dtype="bf16-autocast"), ec.run("mlp", "full_batch", dtype="float32")
    assert bf16.weights["0.weight"].dtype == torch.float32  # float32 master weights
    assert ec.compare(fp32, bf16, rtol=1.3e-6, atol=1e-5).margin > 10


def test_a_grad_scaler_precision_goes_through_every_regime():
    """Gradients recorded at the step are unscaled, so a scaled float32 run equals a plain one."""
    regimes = [ec.parse_regime(r) for r in ec.regimes_for(ec.get_case("mlp"))]
    in_process = [r for r in regimes if not r.distributed and r.unavailable() is None] + [
        ec.parse_regime("summed_loss:chunks=5")]
    report = ec.check("mlp", in_process, dtype=FLOAT32_SCALED)  # a test-only mode cannot cross to worker ranks
    assert report.ok and all(o.verdict is Verdict.EQUIVALENT for o in report.outcomes)
    scaled, plain = ec.run("mlp", "accumulate:chunks=5", dtype=FLOAT32_SCALED), ec.run("mlp", "accumulate:chunks=5",
                                                                                         dtype="float32")
    assert ec.compare(plain, scaled).ok


@dataclasses.dataclass(frozen=True)
class StepsAroundTheScaler(Chunked):
    name = "steps_around_the_scaler"
    summary = "test bug: optimizer.step() called directly, gradients left scaled"

    def train_step(self, model, optimizer, batch, objective):
        loss = backward_chunks(objective.forward_of(model), batch.inputs, batch.targets, self.chunks,
                               lambda out, y: objective.sum(out, y) / batch.items, objective=objective)
        optimizer.step()
        optimizer.zero_grad()
        return loss


def test_stepping_around_the_scaler_is_caught_with_a_scaling_hint():
    (outcome,) = ec.check("mlp", [StepsAroundTheScaler(5)], dtype=FLOAT32_SCALED).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert "every gradient is 256 x the reference's from step 0: likely loss scaling" in outcome.comparison.hint


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_fp16_autocast_is_skipped_here_and_never_faked():
    report = ec.check("mlp", ["accumulate:chunks=5"], dtype="fp16-autocast")
    assert [o.verdict for o in report.outcomes] == [Verdict.SKIPPED] and report.ok
    assert "needs a CUDA device" in report.outcomes[0].reason
    with pytest.raises(ec.Unavailable, match="dtype='fp16-autocast' cannot run here"):
        ec.run("mlp", "full_batch", dtype="fp16-autocast")


@pytest.mark.parametrize(("dtype", "message"), [
    ("float16", "unknown dtype 'float16'; known dtypes: bf16, bf16-autocast, bf16-master, float32, float64, float64-shadow, "
                "float64-shadow-bf16, float64-shadow-scaled, fp16-autocast"),
    (torch.float16, "dtype=torch.float16 is not allowed"),
    (16, "Expected a precision name"),
])
def test_bad_dtype(dtype, message):
    with pytest.raises(ec.InvalidArgument, match=message):
        ec.check("mlp", ["accumulate:chunks=2"], dtype=dtype)


def test_precision_is_a_frozen_value():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRECISIONS["float64"].rtol = 1.0
    assert isinstance(PRECISIONS["bf16-autocast"], Precision)


def test_the_plugin_offers_every_public_precision_mode():
    """The float64 shadows are the harness's own measurement of rounding, not a mode to check in."""
    from equivcheck.precision import PUBLIC_PRECISIONS, SHADOWS
    from pytest_equivcheck.options import DTYPES

    assert DTYPES == tuple(PUBLIC_PRECISIONS) == tuple(p for p in ec.PRECISIONS if p not in SHADOWS)


def test_a_case_resting_on_the_cpu_generator_is_skipped_where_a_mode_trains_on_cuda(monkeypatch):
    """dropout_one_layer is exact only in the CPU generator's draw order: on CUDA it would be a false alarm."""
    monkeypatch.setattr(Precision, "unavailable", lambda self, device: None)  # as on a CUDA machine: nothing trains
    (outcome,) = ec.check("dropout_one_layer", ["accumulate:chunks=4"], dtype="fp16-autocast").outcomes
    assert outcome.verdict is Verdict.SKIPPED
    assert "dropout_one_layer: one dropout layer draws" in outcome.reason and "device='cuda'" in outcome.reason


def test_the_grad_scaler_goes_through_the_ddp_family_on_the_ranks():
    """A registered scaled mode crosses to the ranks by name; a DDP step that stepped around the scaler would
    leave every gradient 65536 times too large."""
    specs = ["ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=3", "ddp_join:world_size=2,chunks=3",
             "zero:world_size=2", "fsdp:world_size=2"]
    report = ec.check("mlp", specs, dtype="float64-shadow-scaled")
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * len(specs)


def plain_step(model, optimizer, batch):
    """A team's step with no scaler of the harness's (its own, if any, the harness does not see)."""
    inputs, targets = batch
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    optimizer.step()


def test_a_teams_step_is_held_to_the_model_not_to_a_scaler_it_never_stepped():
    """The reference's GradScaler state (compared as buffers where both runs step through the harness's scaler) is
    left out against a team's step, which keeps a scaler of its own: no 'buffer names differ'."""
    (outcome,) = ec.check_step("mlp", plain_step, dtype=FLOAT32_SCALED, compare_losses=False).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
