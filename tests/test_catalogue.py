"""The pitfall catalogue: every pitfall caught and every twin passing, to the issue's targets, per precision."""

import dataclasses
import json
import sys

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.suites import catalogue
from equivcheck.suites.catalogue import (Entry, add_entry, catalogue_entries, render_catalogue, run_catalogue,
                                         targets_met, to_rows)
from equivcheck.cli import main


check_module = sys.modules["equivcheck.check"]  # the package's ``check`` is the function


def float32_entries(whole):
    """The entries checked in float32: every one (make test-full), or every eighth and each whose twin trains another
    case (make test: a twin whose memory is measured, for the comparison as it trains)."""
    entries = catalogue_entries()
    return entries if whole else [e for index, e in enumerate(entries) if not index % 8 or e.twin_case]


def float64_located(whole):
    """The entries whose float64 runs are located: every one (make test-full), or every fourth (make test)."""
    return catalogue_entries() if whole else catalogue_entries()[::4]


@pytest.fixture(scope="module")
def rows(whole):
    """Every entry in float64, located (make test: every fourth located, the others verdicts alone); in float32 every
    eighth (make test) or every one (make test-full), located; in bf16-autocast every twelfth or every one, and in
    fp16-autocast every one (skipped without CUDA): verdicts alone, no location is asserted there."""
    located, check_module.LOCATE_BY_DEFAULT = check_module.LOCATE_BY_DEFAULT, True  # where each pitfall parts
    try:
        where = run_catalogue(["float64"], float64_located(whole)) + run_catalogue(["float32"], float32_entries(whole))
    finally:
        check_module.LOCATE_BY_DEFAULT = located
    where += run_catalogue(["float64"], [e for e in catalogue_entries() if e not in float64_located(whole)])
    entries = catalogue_entries()
    return where + run_catalogue(["bf16-autocast"], entries if whole else entries[::12]) + run_catalogue(
        ["fp16-autocast"])


def by_mode(rows, mode):
    return [row for row in rows if row.dtype == mode]


@pytest.mark.sampled
def test_every_pitfall_caught_and_every_twin_passes_to_target(rows):
    assert targets_met(rows), [(r.entry.pitfall, r.dtype, r.shortfalls) for r in rows if r.shortfalls]
    for row in by_mode(rows, "float64"):
        if row.own_bound:  # a compressing comm hook, judged at its own error bound (measured: margin 34, headroom 10)
            assert row.caught and row.margin >= 10 and row.twin_passes and row.headroom >= 2, row.entry.pitfall
            continue
        assert row.caught and (row.caught_by_count or row.margin >= 100), row.entry.pitfall
        assert row.twin_passes and row.headroom >= 100, row.entry.pitfall
    for row in by_mode(rows, "float32"):
        assert row.caught and (row.caught_by_count or row.margin >= 10) and row.twin_passes, row.entry.pitfall
    for row in by_mode(rows, "bf16-autocast"):  # no margin target; measured: every pitfall caught, every twin passes
        assert row.caught and row.twin_passes, row.entry.pitfall
    for row in by_mode(rows, "fp16-autocast"):  # on a CUDA machine (else all skipped): the same, where it can run
        assert row.skipped or (row.caught and row.twin_passes), row.entry.pitfall


def figures(outcome: ec.Outcome) -> tuple:
    return outcome.case, outcome.regime, outcome.verdict, outcome.reason, outcome.comparison


@pytest.mark.sampled
def test_the_catalogue_compared_as_it_trains_gives_every_verdict_hint_figure_and_location_of_the_recorded_one(
        rows, monkeypatch, whole):
    """The pitfalls on up to 2 ranks and their twins (every family but the larger meshes', which compare alike), in
    float32, where a breakdown has the most parts, compared as they train against the fixture's recorded rows: the
    pitfalls are trained again and recorded for their breakdown (hints, float64 shadows, the witness, where they
    part), the twins never. (float64's comparisons are float32's without the shadows.)"""
    recorded = [row for row in by_mode(rows, "float32") if ec.parse_regime(row.entry.regime).world_size <= 2]
    monkeypatch.setattr(check_module, "COMPARE_AS_IT_TRAINS_FROM", 0)
    monkeypatch.setattr(check_module, "LOCATE_BY_DEFAULT", True)
    streamed = run_catalogue(["float32"], [row.entry for row in recorded])
    assert len(recorded) == len(streamed) >= (39 if whole else 5)
    for before, after in zip(recorded, streamed):
        assert figures(after.pitfall) == figures(before.pitfall)
        assert figures(after.twin) == figures(before.twin)
    twins = [row.twin.result for row in streamed if row.twin.verdict is ec.Verdict.EQUIVALENT
             and row.twin.result is not None and not ec.get_case(row.twin.case).regimes]
    assert any(result.measured is not None for result in twins)


def test_a_pitfall_with_right_numbers_is_caught_by_its_count(rows):
    counted = [row for row in by_mode(rows, "float64") if row.caught_by_count]
    assert [row.entry.regime for row in counted] == ["fsdp_sync_every_micro_batch:world_size=2,chunks=3",
                                                     "ddp_detached_partial_sync_every_chunk:world_size=2,chunks=3"]
    assert all(row.margin < 1 and not row.shortfalls for row in counted)
    assert counted[0].pitfall.comparison.problems[0].startswith("communication: step 0 reduce-scattered gradients 15")
    assert counted[1].pitfall.comparison.problems[0].startswith("communication: step 0 all-reduced gradients 4 time(s)")
    line = next(line for line in render_catalogue(counted).splitlines() if "syncing the head" in line)
    assert " count " in line and line.rstrip().endswith("met")


def test_a_row_that_misses_its_target_says_so(rows):
    row = by_mode(rows, "float64")[0]
    weak = type(row)(row.entry, "float64", row.twin, row.twin)  # the twin's outcome in the pitfall's place
    assert weak.shortfalls == (f"pitfall {row.entry.regime} not caught (equivalent)",)
    assert not targets_met([weak])
    assert "MISSED: pitfall" in render_catalogue([weak])


def test_a_row_this_machine_cannot_run_says_skipped_in_every_column_that_would_judge_it(rows):
    row = by_mode(rows, "float64")[0]
    cannot = dataclasses.replace(row.twin, verdict=Verdict.SKIPPED, reason="needs a GPU per rank")
    skipped = type(row)(row.entry, "float64", cannot, cannot)
    first, second = (line for line in render_catalogue([skipped, row]).splitlines()
                     if line.startswith(row.entry.pitfall))
    assert " NO " not in first and first.count(" skipped ") == 2 and first.rstrip().endswith("skipped: needs a GPU per rank")
    assert second.rstrip().endswith("met") and targets_met([skipped, row])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_fp16_autocast_is_skipped_with_its_reason_without_cuda(rows):
    fp16 = by_mode(rows, "fp16-autocast")
    assert fp16 and all(row.skipped and not row.shortfalls for row in fp16)
    assert "needs a CUDA device" in fp16[0].pitfall.reason
    assert "skipped: precision 'fp16-autocast': device='cuda' needs a CUDA device" in render_catalogue(fp16)


def test_hints_name_the_pitfall(rows):
    hints = {row.entry.case: row.pitfall.comparison.hint for row in by_mode(rows, "float64")}
    assert "optimizer.step() (or GradScaler.step) per micro-batch" in hints["step_per_micro_batch"]
    assert "running statistics differ (1.running_mean, 1.running_var)" in hints["batchnorm_cnn"]
    assert "truncated BPTT" in hints["gru_detached_hidden"] and "1.weight match" in hints["gru_detached_hidden"]
    assert "mean / K" in hints["naive_scaling_uneven_chunks"] and "dropout" in hints["dropout_two_layers"]
    for case in ("zero_grad_inside_loop", "clip_per_micro_batch", "scaler_unscale_per_micro_batch"):
        assert "inside the accumulation loop" in hints[case]
    twin = by_mode(rows, "float64")[0].twin.comparison
    assert twin.ok and twin.hint == ""


def test_json_rows_and_the_command(rows, tmp_path, capsys, monkeypatch):
    records = to_rows(rows)
    assert len(records) == len(rows) >= 2 * len(catalogue_entries())
    assert {r["dtype"] for r in records if r["skipped"]} <= {"fp16-autocast"}
    path = tmp_path / "catalogue.json"
    asked = []  # the command renders the rows the fixture measured, not a second measurement of them

    def measured(dtypes, entries, isolate):
        asked.append((dtypes, isolate))
        assert entries == catalogue_entries()  # without --case, every entry
        return by_mode(rows, "float64")

    monkeypatch.setattr(catalogue, "run_catalogue", measured)
    assert main(["catalogue", "--dtype", "float64", "--json", str(path)]) == 0
    assert asked == [(["float64"], True)]  # its runs isolated: a precision whose kernels kill a process is an error row
    out = capsys.readouterr().out
    assert f"{len(catalogue_entries())} rows ({len(catalogue_entries())} pitfalls x 1 precisions); every target met" in out
    assert "gradient clipping per micro-batch" in out and "headroom" in out
    assert json.loads(path.read_text())[0]["caught"] is True


def test_entries_are_validated_before_anything_runs():
    with pytest.raises(ec.InvalidArgument, match="does not declare 'accumulate:chunks=5'"):
        run_catalogue(["float64"], [Entry("not declared", "mlp", "accumulate:chunks=5", "accumulate:chunks=5")])
    with pytest.raises(ec.InvalidArgument, match="unknown dtype 'float16'"):
        run_catalogue(["float16"])
    with pytest.raises(ec.InvalidArgument, match="pitfall='sampler drops the remainder'"):
        add_entry(Entry("sampler drops the remainder", "sampler_drop", "sampler_drop:chunks=5", "accumulate:chunks=5"))
    with pytest.raises(ec.InvalidArgument, match="twin=None is not allowed: regime 'accumulate:chunks=5' declares no"):
        Entry("a faithful regime", "mlp", "accumulate:chunks=5")


def test_a_pitfall_is_held_against_the_twin_its_regime_declares():
    """The twin an entry runs is the one its regime declares, unless it holds something else on another case."""
    held = [(e.regime, e.twin) for e in catalogue_entries()
            if ec.parse_regime(e.regime).pitfall and e.twin_case is None]
    assert len(held) >= 20
    assert all(twin == str(type(ec.parse_regime(regime)).pitfall.twin_of(regime)) for regime, twin in held), held
    assert Entry("x", "mlp", "naive_accumulate:chunks=5").twin == "accumulate:chunks=5"


# Where each pitfall parts (issue 56): its phase, and its module where it has one ("" where none applies: the batch,
# the loss, a count); None where it is left unsaid. The rows with a comment are not located where their fix acts.
WHERE_IT_PARTS = {
    ("naive_scaling_uneven_chunks", "naive_accumulate:chunks=5"): ("loss", ""),
    ("zero_grad_inside_loop", "zero_grad_inside:chunks=5"): ("gradient", "0"),
    ("step_per_micro_batch", "step_per_micro_batch:chunks=5"): ("optimizer", ""),
    ("scaler_unscale_per_micro_batch", "scaler_unscale_per_micro_batch:chunks=5"): ("gradient", "0"),
    ("scaler_step_per_micro_batch", "scaler_step_per_micro_batch:chunks=5"): ("optimizer", ""),
    ("sampler_pad", "sampler_pad:chunks=5"): ("forward", ""),
    ("sampler_drop", "sampler_drop:chunks=5"): ("forward", ""),
    ("batchnorm_cnn", "accumulate:chunks=5"): ("forward", "1"),
    ("batchnorm_cnn", "ddp:world_size=2"): ("forward", "1"),
    ("fsdp_sync_every_micro_batch", "fsdp_sync_every_micro_batch:world_size=2,chunks=3"): ("communication", ""),
    ("clip_per_micro_batch", "clip_per_micro_batch:chunks=5,max_norm=0.1"): ("gradient", "0"),
    ("naive_scaling_uneven_tokens", "naive_accumulate:chunks=4"): ("loss", ""),
    ("pipeline_uneven_tokens", "pipeline_mean_loss:stages=2,microbatches=4"): ("loss", ""),
    ("pipeline_uneven_tokens", "pipeline_scaled_twice:stages=2,microbatches=4"): ("gradient", "0"),
    ("ddp_compressed_uneven_shards", "ddp_hook_mean_loss:world_size=2,hook=fp16"): ("loss", ""),
    ("ddp_uneven_shards", "ddp_mean_loss:world_size=2"): ("loss", ""),
    ("ddp_mean_loss_uneven_tokens", "ddp_mean_loss:world_size=2"): ("loss", ""),
    # ideally loss: the rank that joined trains no tail step, and the other's mean is halved by the join's average
    ("ddp_join_uneven_tail", "ddp_join_rank_mean:world_size=2,chunks=3"): ("gradient", "0"),
    ("ddp_uneven_shards", "ddp_padded_sampler:world_size=2"): ("forward", ""),
    ("dropout_two_layers", "accumulate:chunks=4"): ("forward", "2"),
    # ideally backward: micro-batch 1's forward recomputed inside its backward draws other masks, and moves the stream
    # micro-batch 2's forward draws from: the walk, which tries every forward before any backward, meets that first
    ("checkpoint_dropout", "checkpoint_without_rng_state:chunks=4"): ("forward", "2"),
    # the masks drawn from a stream seeded otherwise: the random state the dropout began from
    ("dropout_two_layers", "tp_dropout_rank_seeded:world_size=2"): ("state", ""),
    ("routed_tokens", "ddp_aux_over_world:world_size=2"): ("loss", ""),
    ("routed_tokens", "ddp_aux_times_world:world_size=2"): ("loss", ""),
    ("routed_bias_per_micro_batch", "accumulate:chunks=4"): ("forward", ""),
    # the experts' own reduction divides by the world; over their replicas: read by a whole count, the rest right
    ("routed_tokens", "ep_experts_averaged:world_size=2"): ("communication", "experts"),
    ("routed_tokens", "fsdp_ep_experts_over_dp:dp=2,ep=2"): ("communication", "experts"),
    ("gru_detached_hidden", "per_token:detach=1"): ("backward", "0.cell"),
    ("resume_tokens", "resume_without_optimizer:at=1"): ("state", "0"),
    ("resume_tokens", "resume_from_the_start:at=1"): ("forward", ""),
    ("resume_schedule", "resume_without_scheduler:at=1"): ("state", ""),
    ("resume_dropout", "resume_without_rng:at=1"): ("state", ""),
    # ideally state: a sharded optimizer's state is not compared
    ("resume_tokens", "fsdp:world_size=2>resume_optimizer_of_rank_zero:at=1"): ("optimizer", "0"),
    ("seed000_ddp", "ddp_detached_partial_bypass:world_size=2,chunks=3"): ("communication", "0.0"),
    ("seed000_ddp", "ddp_detached_partial_in_forward:world_size=2,chunks=3"): ("communication", "1"),
    ("seed000_ddp", "ddp_detached_partial_sync_every_chunk:world_size=2,chunks=3"): ("communication", ""),
    ("sp_block", "tp_sp_norm_unreduced:world_size=2"): ("communication", "norm"),
    ("tp_mlp", "tp_different_batches:world_size=2"): ("forward", ""),
    ("tp_mlp", "tp_loss_scaled:world_size=2"): ("loss", ""),
    ("tp_mlp", "fsdp_tp_world_scaled:dp=2,tp=2"): ("loss", ""),
    # the schedule divides every gradient by K after backward: its ranks' shards joined, each the reference's / K
    ("tp_blocks", "pp_fsdp_tp_scaled_twice:pp=2,dp=2,tp=2"): ("gradient", "0.0"),
    # unsaid: the ranks of each tensor-parallel group were fed other micro-batches, so no join gives the model's output
    ("tp_blocks", "pp_fsdp_tp_ranks_differ:pp=2,dp=2,tp=2"): None,
    ("tp_mlp_clipped", "tp_clip_local:world_size=2,max_norm=0.05"): ("gradient", "0"),
    # the norm computed otherwise scales every gradient after FSDP2's reductions left them right
    ("clip_on_shards", "fsdp_clip_averaged:world_size=2,max_norm=0.1"): ("gradient", "0"),
    ("clip_on_shards", "hsdp_clip_over_replicas:replicate=2,shard=1,max_norm=0.1"): ("gradient", "0"),
    ("clip_on_experts", "ep_clip_local_experts:world_size=2,max_norm=2.0"): ("gradient", "router"),
    ("clip_on_experts", "fsdp_ep_clip_local_experts:dp=2,ep=2,max_norm=2.0"): ("gradient", "router"),
    ("clip_on_stages", "pipeline_clip_tied_per_stage:stages=2,microbatches=4,max_norm=2.0"): ("gradient", "0"),
    ("rl_token_mean", "terms_per_micro_batch:chunks=3"): ("loss", ""),
    ("rl_token_mean", "accumulate_divided_twice:chunks=3"): ("loss", ""),
    # unsaid: the trunk's modules ran inside a reentrant checkpoint's forward, which keeps no graph of them to read
    ("lora_tied", "checkpoint_reentrant:chunks=2"): None,
    ("lora_sp_block", "tp_sp_norm_unreduced:world_size=2"): ("communication", "up.lora_a"),
    # read per document: the packer's bugs, and an attention whose mask crosses the packed documents
    ("packed_documents", "packed_positions_run_on"): ("forward", ""),
    ("packed_documents", "packed_label_across"): ("loss", ""),
    ("packed_documents", "packed_row_mean"): ("loss", ""),
    ("packed_documents_causal_only", "packed"): ("forward", "attention"),
}


def test_every_pitfall_is_located_in_its_phase_in_float64_and_float32(rows, whole):
    located = [row for row in rows if not row.skipped and (row.dtype == "float32" or (
        row.dtype == "float64" and row.entry in float64_located(whole)))]
    found = {(row.entry.case, row.entry.regime) for row in located}
    assert found == set(WHERE_IT_PARTS) if whole else found <= set(WHERE_IT_PARTS)
    wrong = []  # every row located elsewhere, said at once
    for row in located:
        location, expected = row.pitfall.location, WHERE_IT_PARTS[(row.entry.case, row.entry.regime)]
        found = None if location is None else (location.phase, location.module)
        if found != expected:
            wrong.append((row.dtype, row.entry.regime, expected, location, row.pitfall.reason))
    assert not wrong, wrong
    assert all(row.twin.location is None for row in located)  # an equivalent twin is never located
