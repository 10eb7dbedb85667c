"""Precision policies (issue 66), each applied to the reference and to every regime alike: pure bf16 (parameters,
gradients and optimizer state in bfloat16: ``dtype=torch.bfloat16``) and bf16 over float32 master weights
(``dtype="bf16-master"``: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
as a single process computes it). Under each, faithful regimes are equivalent and a planted fault is caught; the FSDP2
recipe a team's wrap sets is equivalent judged under the policy it sets, and a fault in that team's step is caught."""

import dataclasses

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.judge import witness
from equivcheck.precision import PRECISIONS
from equivcheck.process import kernels
from equivcheck.strategies import CaseSpec

from precision_wraps import shard_in_bf16
from test_team_parallel import DEFAULT_MESH_FITS, train_step, train_step_forgetting_zero_grad

POLICIES = ("bf16", "bf16-master")


@pytest.fixture(autouse=True)
def bf16_kernels_run():
    if kernels.probe(PRECISIONS["bf16"], kernels.DEFAULT) != "ran":
        pytest.skip("this CPU's default bf16 kernels die (oneDNN on AMX): bf16 parameters cannot compute here")


def test_pure_bf16_keeps_parameters_gradients_and_optimizer_state_in_bf16_on_ranks_too():
    for spec in ("full_batch", "ddp:world_size=2"):
        result = ec.run("mlp", spec, dtype=torch.bfloat16)
        assert result.precision == "bf16"
        assert {t.dtype for t in result.weights.values()} == {torch.bfloat16}, spec  # crossed from its ranks as bf16
        assert {t.dtype for step in result.grads for t in step.values()} == {torch.bfloat16}, spec
        parameters, _, state = result.state_bytes
        elements = sum(t.numel() for t in result.weights.values())
        assert parameters == state == 2 * elements, "the weights and SGD's momentum held at 2 bytes an element"


def test_bf16_master_keeps_float32_weights_and_gradients_and_computes_in_bf16():
    master, float32 = ec.run("mlp", "full_batch", dtype="bf16-master"), ec.run("mlp", "full_batch", dtype="float32")
    assert {t.dtype for t in master.weights.values()} == {torch.float32}
    assert {t.dtype for step in master.grads for t in step.values()} == {torch.float32}
    assert ec.compare(float32, master).margin > 10, "the forward and backward really ran in bfloat16"


@pytest.mark.parametrize("dtype", POLICIES)
def test_faithful_regimes_are_equivalent_under_each_policy(dtype):
    specs = ["accumulate:chunks=5", "ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=3", "fsdp:world_size=2"]
    report = ec.check("mlp", specs, dtype=dtype)
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * len(specs), report
    assert all(o.comparison.tolerance == ec.Tolerance(1.6e-2, 2**-8) for o in report.outcomes)


@pytest.mark.parametrize("dtype", POLICIES)
@pytest.mark.parametrize(("case", "pitfall", "twin"), [
    ("naive_scaling_uneven_chunks", "naive_accumulate:chunks=5", "accumulate:chunks=5"),
    ("ddp_uneven_shards", "ddp_mean_loss:world_size=2", "ddp:world_size=2"),
])
def test_a_planted_fault_is_caught_under_each_policy_and_its_twin_passes(dtype, case, pitfall, twin):
    outcomes = {o.regime: o for o in ec.check(case, [pitfall, twin], dtype=dtype).outcomes}
    caught = outcomes[pitfall]
    assert caught.verdict in (Verdict.MISMATCH, Verdict.EXPECTED_MISMATCH), caught.describe()
    # beyond the policy's tolerance, and no rounding of its: the float64 runs from the same draws differ too
    assert caught.comparison.margin > 2 and "the maths differs" in caught.comparison.note, caught.describe()
    assert outcomes[twin].verdict is Verdict.EQUIVALENT, outcomes[twin].describe()


@DEFAULT_MESH_FITS
def test_the_fsdp2_bf16_recipe_is_judged_under_the_policy_it_sets_and_its_teams_fault_is_caught():
    """Judged at float32 the recipe computes in bf16 and its reference does not, which the location names with the
    argument that judges it (test_locate_precision.py); under that argument the recipe is equivalent."""
    (recipe,) = ec.check_step("mlp", train_step, world_size=2, wrap=shard_in_bf16, dtype="bf16-master").outcomes
    assert recipe.verdict is Verdict.EQUIVALENT, recipe.describe()
    (fault,) = ec.check_step("mlp", train_step_forgetting_zero_grad, world_size=2, wrap=shard_in_bf16,
                             dtype="bf16-master").outcomes
    assert fault.verdict is Verdict.MISMATCH and fault.comparison.margin > 10, fault.describe()


def test_bfloat16_is_a_dtype_a_check_takes_and_a_case_does_not():
    assert ec.resolve_precision(torch.bfloat16) is PRECISIONS["bf16"]
    with pytest.raises(ec.InvalidArgument, match=r"dtype=torch.float16 is not allowed: expected torch.float64, "
                                                  r"torch.float32, torch.bfloat16 \(or a mode name\)"):
        ec.resolve_precision(torch.float16)
    with pytest.raises(ec.InvalidArgument, match="dtype=torch.bfloat16 is not allowed"):
        dataclasses.replace(ec.get_case("mlp"), dtype=torch.bfloat16)  # a case draws in float64 or float32


class TiedHead(torch.nn.Module):
    """A head tied to the embedding, read by the model's own forward: no module owns the matmul that uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)

    def forward(self, ids):
        return torch.tanh(self.mix(self.embed(ids))) @ self.embed.weight.T


TIED = ec.Case(name="bf16_tied_head", model=TiedHead,
               data=lambda: (torch.randint(0, 10, (24,)), torch.randint(0, 10, (24,))),
               loss=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"), batch_size=8,
               steps=3)


def test_bf16_master_casts_a_weight_the_models_own_forward_reads_once_for_the_whole_call():
    """The outermost call casts every parameter below it: the tied head's matmul in the model's forward reads the
    embedding's bfloat16 copy (cast module by module it read the float32 master: 'mat1 and mat2 must have the same
    dtype')."""
    report = ec.check(TIED, ["accumulate:chunks=2"], dtype="bf16-master")
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert "torch.bfloat16" in ec.run(TIED, "full_batch", dtype="bf16-master").loss_dtypes


def attention_lm(batch_size: int, widths: tuple[int, int], block: int) -> ec.Case:
    """A drawn attention LM (its key biases' true gradient is zero: softmax ignores a constant added to a row's
    scores) trained by AdamW without epsilon, which makes a whole update of that gradient's rounding, float64's
    too."""
    return CaseSpec(widths=widths, activation="gelu", dtype="float32", batch_size=batch_size, steps=2,
                    loss="cross_entropy", optimizer="adamw_no_eps", lr=1e-3, heads=4, block=block,
                    attention_bias=True, tied=True).build()


# Pure bf16 accumulates each micro-batch's gradient into a bfloat16 one, rounding at the parts' scale: 9 chunks of 23
# samples part from the full batch at step 0 by margin 1.04 (a LayerNorm's weight); 2 of 2 samples part at step 1.
# The float64 shadows part too, but only in the key bias's end weights, which each moved by its own float64 rounding.
ACCUMULATED_IN_BF16 = [(attention_lm(23, (12, 7), 3), "accumulate:chunks=9", "naive_accumulate:chunks=9"),
                       (attention_lm(2, (12, 3), 2), "accumulate:chunks=2", "zero_grad_inside:chunks=2")]


@pytest.mark.parametrize(("case", "faithful", "pitfall"), ACCUMULATED_IN_BF16, ids=["step0", "step1"])
def test_pure_bf16_rounding_is_told_where_the_float64_runs_part_only_by_their_own_rounding(case, faithful, pitfall):
    outcomes = {o.regime: o for o in ec.check(case, [faithful, pitfall], dtype=torch.bfloat16).outcomes}
    kept = outcomes[faithful]
    assert kept.verdict is Verdict.EQUIVALENT, kept.describe()
    assert "the float64 runs match, but for weights float64's own rounding moves (weight of " \
           "'trunk.attn.in_proj_bias'" in kept.reason, kept.reason
    assert kept.reason.startswith("ill-conditioned") and "is the runs' own rounding" in kept.reason
    caught = outcomes[pitfall]  # its twin: a fault that changes a real gradient is the float64 maths' too
    assert caught.verdict is Verdict.MISMATCH and "the float64 runs differ too" in caught.comparison.note, \
        caught.describe()


def test_without_the_float64_runs_own_rounding_weighed_the_same_accumulation_is_a_false_alarm(monkeypatch):
    """The guard's own test: where the float64 shadows' key-bias difference is not weighed by their own rounding,
    the faithful accumulation above is a mismatch (the false alarm bench_false_alarms.py --dtype bf16 counted)."""
    monkeypatch.setattr(witness, "rounding_alone", lambda *args, **kwargs: None)
    case, faithful, _ = ACCUMULATED_IN_BF16[0]
    (outcome,) = ec.check(case, [faithful], dtype=torch.bfloat16).outcomes
    assert outcome.verdict is Verdict.MISMATCH and "the maths differs" in outcome.comparison.note, outcome.describe()
