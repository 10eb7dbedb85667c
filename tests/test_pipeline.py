"""Pipeline parallelism (torch.distributed.pipelining) on the warm pool: each schedule exact against full batch,
every rank reporting the whole model's gradients and weights; the loss normalised per micro-batch caught."""

import dataclasses

import pytest
import torch
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.render.markdown import render_markdown
from equivcheck.render.rows import to_rows
from equivcheck.render.html import render_html, run_metadata
from equivcheck.regimes.pipeline import stage_bounds

import parallel_bugs  # noqa: F401  (registers the bugs; the ranks import it by name)

PIPELINE_SPECS = ["pipeline:stages=2,microbatches=4", "pipeline:stages=2,microbatches=4,schedule=1f1b",
                  "pipeline:stages=2,microbatches=4,schedule=interleaved"]


@pytest.fixture(scope="module")
def block_stack():
    return ec.check("block_stack", ["accumulate:chunks=4", *PIPELINE_SPECS, "pipeline:stages=3,microbatches=6",
                                    "pipeline:stages=3,microbatches=3,schedule=1f1b"])


@pytest.mark.parametrize("spec", [*PIPELINE_SPECS, "pipeline:stages=3,microbatches=6",
                                  "pipeline:stages=3,microbatches=3,schedule=1f1b"])
def test_every_schedule_matches_full_batch_with_headroom(block_stack, spec):
    outcome = block_stack.outcome("block_stack", spec)
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.comparison
    # Every rank steps the whole gradient (the stage owners broadcast theirs): the ranks never stand apart.
    result = outcome.result
    assert result.rank_spread == 0 and all(spread == 0 for step in result.rank_grad_spread for spread in step)
    assert len(result.grads) == 3 and set(result.grads[0]) == set(result.weights)  # every parameter, every step


def test_a_pipeline_adds_the_micro_batches_up_as_accumulation_does(block_stack):
    """K equal micro-batches, each its sum over the global items, added in order: accumulate's arithmetic exactly."""
    accumulated = block_stack.outcome("block_stack", "accumulate:chunks=4").result
    for spec in PIPELINE_SPECS:
        piped = block_stack.outcome("block_stack", spec).result
        for mine, theirs in zip(piped.grads, accumulated.grads):
            assert all(torch.equal(mine[name], theirs[name]) for name in theirs), spec
        assert piped.losses == pytest.approx(accumulated.losses, rel=1e-12)


@pytest.mark.parametrize("spec", ["pipeline:stages=2,microbatches=4", "pipeline:stages=2,microbatches=4,schedule=1f1b",
                                  "pipeline:stages=3,microbatches=6"])
def test_the_first_stage_sends_each_micro_batch_forward_and_receives_its_gradient(block_stack, spec):
    """Rank 0 holds stage 0 alone: per step it sends K activations and receives K activation gradients, each one
    micro-batch of stage 0's output. The first step also sends the shapes (PipelineStage infers them then). The
    harness's broadcast of every stage's gradients (for the report) is not the pipeline's and is not counted."""
    regime, case = ec.parse_regime(spec), ec.get_case("block_stack")
    model, (inputs, _) = case.model().double(), case.data()
    start, stop = stage_bounds(len(model), regime.stages)[0]
    micro_batch = inputs[: case.batch_size // regime.microbatches].double()
    sent = model[start:stop](micro_batch).detach()
    each = sent.numel() * sent.element_size()
    result = block_stack.outcome("block_stack", spec).result
    k = regime.microbatches
    assert result.collectives[1:] == ({"send": (k, k * each), "recv": (k, k * each)},) * 2, result.collectives
    assert result.collectives[0]["send"][0] > k and result.collectives[0]["recv"][0] >= k  # and the shapes, once
    assert result.syncs is None  # stages exchange activations: there is no gradient sync to judge


def test_reports_show_the_pipelines_traffic_by_kind(block_stack):
    rows = to_rows(block_stack)
    row = next(r for r in rows if r["regime"] == "pipeline:stages=2,microbatches=4")
    assert set(row["collectives"][1]) == {"send", "recv"} and row["syncs"] is None
    metadata = run_metadata(seed=0, dtype=None, backend=None, world_sizes=[2])
    assert "pipeline:stages=2,microbatches=4" in render_html(rows, metadata)
    assert "| block_stack | 6 ok | - |" in render_markdown(rows)  # Markdown summarises per case


def test_micro_batch_mean_loss_is_caught_on_uneven_token_counts():
    report = ec.check("pipeline_uneven_tokens")
    report.assert_equivalent()
    faithful = report.outcome("pipeline_uneven_tokens", "pipeline:stages=2,microbatches=4")
    assert faithful.verdict is Verdict.EQUIVALENT and faithful.comparison.margin < 1e-2
    for spec in ("pipeline_mean_loss:stages=2,microbatches=4", "pipeline_scaled_twice:stages=2,microbatches=4"):
        wrong = report.outcome("pipeline_uneven_tokens", spec)
        assert wrong.verdict is Verdict.EXPECTED_MISMATCH and wrong.comparison.margin > 100, spec


def test_micro_batch_mean_loss_passes_where_every_micro_batch_holds_as_many_items():
    """Torch's pairing (mean loss, scale_grads=True) is right on equal micro-batches: the tokens case is what tells."""
    outcome = ec.check("block_stack", ["pipeline_mean_loss:stages=2,microbatches=4"]).outcomes[-1]
    assert outcome.comparison.ok and outcome.comparison.margin < 1e-2


def test_stages_are_contiguous_runs_of_children_evenly_by_count():
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pipeline:stages=2,microbatches=4,schedule=zb", "schedule='zb' is not allowed: expected one of gpipe, 1f1b, interleaved"),
        ("pipeline:stages=0,microbatches=4", "stages=0 is not allowed: expected an integer >= 1"),
        ("pipeline:stages=2,microbatches=0", "microbatches=0 is not allowed: expected an integer >= 1"),
        ("pipeline:stages=2,microbatches=5,schedule=interleaved",
         "microbatches=5 is not allowed with schedule=interleaved and stages=2"),
        ("pipeline:stages=3,microbatches=2,schedule=1f1b",
         "microbatches=2 is not allowed with schedule=1f1b: expected an integer >= stages=3"),
        ("pipeline:stages=2,microbatches=4,backend=mpi", "backend='mpi' is not allowed: expected one of auto, gloo, nccl"),
        ("pipeline:stages=2", "pipeline needs microbatches (e.g. 'pipeline:microbatches=2')"),
        ("pipeline:stages=2,microbatches=4,world_size=2", "pipeline takes stages=..., microbatches=..., schedule=..., backend=..."),
    ],
)
def test_bad_options_name_the_option_its_value_and_what_is_allowed(spec, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.parse_regime(spec)
    assert message in str(raised.value)


def test_a_case_that_cannot_be_cut_is_named():
    regime = ec.parse_regime("pipeline:stages=4,microbatches=2")
    with pytest.raises(ec.InvalidArgument, match="on case 'mlp': the case's model cannot be cut into 4 pipeline stages: "
                                                 "it is an nn.Sequential of 3 children"):
        regime.validate(ec.get_case("mlp"))
    interleaved = ec.parse_regime("pipeline:stages=2,microbatches=2,schedule=interleaved")
    with pytest.raises(ec.InvalidArgument, match=r"cannot be cut into 4 pipeline stages.*stages=2 x 2 per rank"):
        interleaved.validate(ec.get_case("mlp"))
    tree = dataclasses.replace(ec.get_case("mlp"), name="tree", model=lambda: nn.ModuleDict({"a": nn.Linear(6, 3)}))
    with pytest.raises(ec.InvalidArgument, match="on case 'tree'.*it is a ModuleDict, not an nn.Sequential"):
        ec.parse_regime("pipeline:stages=2,microbatches=2").validate(tree)
    called = dataclasses.replace(ec.get_case("mlp"), name="called", forward=lambda model, inputs, targets: model(inputs))
    with pytest.raises(ec.InvalidArgument, match="on case 'called': the case calls its model through forward="):
        ec.parse_regime("pipeline:stages=2,microbatches=2").validate(called)


def test_nccl_and_cuda_modes_are_skipped_with_the_reason():
    outcome = ec.check("block_stack", ["pipeline:stages=2,microbatches=4,backend=nccl"]).outcomes[-1]
    assert outcome.verdict is Verdict.SKIPPED and "run on the CPU over gloo only" in outcome.reason


def test_micro_batches_must_divide_the_global_batch():
    with pytest.raises(ec.InvalidArgument, match="microbatches=5 is not allowed: expected a divisor of batch_size=12"):
        ec.check("block_stack", ["pipeline:stages=2,microbatches=5"])


def test_a_weight_tied_across_stages_is_summed_over_the_ranks_holding_it():
    """The tokens model with its output layer tied to its embedding, on two stages: each rank's copy gets its own use's
    gradient, and the copies are all-reduced between the two ranks (Megatron's embedding group): equivalent, and with
    that reduction taken out (each stage stepping its own use alone), caught in the tied weight."""
    outcomes = {o.regime: o for o in ec.check("clip_on_stages", ["pipeline:stages=2,microbatches=4",
                                                                 "pipeline_tied_unreduced:stages=2,microbatches=4"],
                                              locate=True).outcomes}
    assert outcomes["pipeline:stages=2,microbatches=4"].verdict is Verdict.EQUIVALENT
    unreduced = outcomes["pipeline_tied_unreduced:stages=2,microbatches=4"]
    assert unreduced.verdict is Verdict.MISMATCH and unreduced.comparison.margin > 1e3, unreduced.describe()
    assert {m.name for m in unreduced.comparison.mismatches if m.kind == "grad"} == {"0.weight"}
