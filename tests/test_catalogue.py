"""The pitfall catalogue: every pitfall caught and every twin passing, to the issue's targets, per precision."""

import dataclasses
import json

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.suites import catalogue
from equivcheck.suites.catalogue import (Entry, add_entry, catalogue_entries, render_catalogue, run_catalogue,
                                         targets_met, to_rows)
from equivcheck.cli import main


@pytest.fixture(scope="module")
def rows():
    return run_catalogue(["float64", "float32", "bf16-autocast", "fp16-autocast"])


def by_mode(rows, mode):
    return [row for row in rows if row.dtype == mode]


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
    assert len(records) == 4 * len(catalogue_entries())
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
