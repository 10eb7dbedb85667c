"""Resuming from a checkpoint: two segments in fresh processes, compared with the uninterrupted reference."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.regimes.resume import Resume
from equivcheck.runners.ranks import pool

import device_cases
from processes import alive

FAITHFUL = ["resume:at=1", "accumulate:chunks=2>resume:at=1>ddp:world_size=2",
            "fsdp:world_size=4>resume:at=1>fsdp:world_size=2", "fsdp:world_size=2>resume:at=1>fsdp:world_size=4",
            "fsdp_tp:dp=2,tp=2>resume:at=1>fsdp:world_size=2"]


def test_a_faithful_resume_is_exact_in_process_and_resharded_on_ranks():
    """FSDP2 saved on 4 ranks and restored on 2 (and 2 -> 4), a 2 x 2 mesh restored as FSDP2 on 2: equivalent, each
    to its accumulation's reordering; one process's resume is exact."""
    report = ec.check("tokens", FAITHFUL)
    for outcome in report.outcomes:
        assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert report.outcomes[0].comparison.margin == 0.0
    assert report.outcome("tokens", FAITHFUL[2]).result.optimizer_steps == 2  # one step saved, one restored


@pytest.mark.parametrize(("case", "pitfall"), [("resume_tokens", "resume_from_the_start:at=1"),
                                               ("resume_dropout", "resume_without_rng:at=1")])
def test_each_part_left_out_of_the_checkpoint_is_caught_from_the_resumed_step(case, pitfall):
    (outcome,) = ec.check(case, [pitfall]).outcomes
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 1000, outcome.describe()
    assert outcome.comparison.first_divergent_step == 1  # the step saved before the restart matches


def test_a_sharded_optimizer_restored_from_rank_zeros_shard_is_caught_where_it_is_sharded():
    """Rank 0's optimizer.state_dict() loaded on every rank: under FSDP2 the other rank's half of Adam's moments is
    rank 0's (half of every weight's elements end wrong); under DDP every rank holds the whole state, so it is right.
    ZeRO's own state goes through its consolidate_state_dict, and resumes exactly."""
    fsdp, ddp, zero = ec.check("tokens", ["fsdp:world_size=2>resume_optimizer_of_rank_zero:at=1",
                                          "ddp:world_size=2>resume_optimizer_of_rank_zero:at=1",
                                          "zero:world_size=2>resume:at=1"]).outcomes
    assert fsdp.verdict is Verdict.MISMATCH and fsdp.comparison.margin > 1000, fsdp.describe()
    assert ddp.verdict is Verdict.EQUIVALENT and zero.verdict is Verdict.EQUIVALENT, (ddp.describe(), zero.describe())


def test_a_schedule_restarted_on_resume_is_caught_one_step_after_the_save_and_a_saved_one_is_exact():
    """Within a warmup: the restored optimizer holds the saved rate, so the step after the save is right; the fresh
    scheduler then sets the next one wrong. torch.distributed.checkpoint's own step at rate 0 (it creates the fresh
    optimizer's state) is no step of the schedule's: stepped by it, the lost scheduler would look restored."""
    faithful, lost, zero = ec.check("resume_schedule", ["resume:at=1", "resume_without_scheduler:at=1",
                                                        "zero:world_size=2>resume:at=1>ddp:world_size=2"]).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT and faithful.comparison.margin == 0.0, faithful.describe()
    assert zero.verdict is Verdict.EQUIVALENT, zero.describe()  # ZeRO's one consolidated file, into a whole optimizer
    assert lost.verdict is Verdict.EXPECTED_MISMATCH and lost.comparison.margin > 1000, lost.describe()
    assert lost.comparison.first_divergent_step == 3  # step 2's weights are the first the wrong rate moved


def test_a_schedule_is_refused_where_it_cannot_be_lost_or_restored():
    with pytest.raises(ec.InvalidArgument, match="the case has no scheduler= to lose"):
        ec.check("tokens", ["resume_without_scheduler:at=1"])
    with pytest.raises(ec.InvalidArgument, match="helpers do not take a ZeroRedundancyOptimizer: expected ZeRO before"):
        ec.check("tokens", ["ddp:world_size=2>resume:at=1>zero:world_size=2"])


@pytest.mark.parametrize("before", ["", "fsdp:world_size=2>"])
def test_optimizer_state_left_out_is_caught_in_the_update_it_steers(before):
    """Step 1's gradients come from the restored weights, which are right; Adam's restarted moments then move the
    weights otherwise: the final weights are what differ, resharded (2 -> 4 ranks) too."""
    after = ">fsdp:world_size=4" if before else ""
    (outcome,) = ec.check("resume_tokens", [f"{before}resume_without_optimizer:at=1{after}"]).outcomes
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 1000, outcome.describe()
    assert {m.kind for m in outcome.comparison.mismatches} == {"weight"}


def test_each_segment_trains_in_processes_started_for_it_which_end_with_it(tmp_path, monkeypatch):
    """What a restart loses is lost: the restored segment's ranks are not the saving segment's, none outlives its
    segment, no warm pool is left, and the checkpoint's folder is removed."""
    record = tmp_path / "trained_in"
    monkeypatch.setenv(device_cases.RECORD_VARIABLE, str(record))
    warm_before = set(pool._pools)
    result = ec.run(device_cases.CASE_NAME, "ddp:world_size=2>resume:at=1")
    built = [int(line.split()[0]) for line in record.read_text().split("\n") if line]
    assert len(built) == 4 and len(set(built)) == 4  # two ranks per segment, four processes
    assert not any(alive(pid) for pid in built)
    assert set(pool._pools) == warm_before and result.optimizer_steps == 2
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"{pool.CHECKPOINT_PREFIX}{os.getpid()}-*"))


def test_specs_join_regimes_around_a_resume_and_print_back():
    resumed = ec.parse_regime("fsdp:world_size=4>resume:at=2>fsdp:world_size=2")
    assert isinstance(resumed, Resume) and resumed.at == 2 and resumed.world_size == 4
    assert resumed.segments == (ec.parse_regime("fsdp:world_size=4"), ec.parse_regime("fsdp:world_size=2"))
    assert str(resumed) == "fsdp:world_size=4>resume:at=2>fsdp:world_size=2"
    assert str(ec.parse_regime("ddp:world_size=2>resume:at=1>ddp:world_size=2")) == "ddp:world_size=2>resume:at=1"
    assert str(ec.parse_regime("full_batch>resume:at=1")) == "resume:at=1"
    # a pitfall's twin joins the same regimes
    twin = ec.REGIMES["resume_without_rng"].pitfall.twin_of("ddp:world_size=2>resume_without_rng:at=1>fsdp:world_size=2")
    assert str(twin) == "ddp:world_size=2>resume:at=1>fsdp:world_size=2"


@pytest.mark.parametrize(("spec", "says"), [
    ("ddp:world_size=2>accumulate:chunks=2", "'>' joins at most one regime on each side of a resume"),
    ("a>b>resume:at=1", "'>' joins at most one regime on each side of a resume"),
    ("resume:at=1>resume:at=1", "at=1 is not allowed: expected more than the save before it"),
    ("ddp:world_size=2>fsdp:world_size=2>resume:at=1", "'>' joins at most one regime on each side of a resume"),
    ("resume", "resume needs at"),
    ("resume:at=0", "at=0 is not allowed"),
])
def test_a_spec_that_does_not_read_is_refused_saying_how_to_write_one(spec, says):
    with pytest.raises(ec.InvalidArgument, match=says.replace("(", r"\(")):
        ec.parse_regime(spec)


def test_a_save_must_fall_between_two_of_the_cases_global_batches():
    with pytest.raises(ec.InvalidArgument, match=r"at=2 is not allowed: expected 1 to 1, a save between two of the "
                                                 r"case's 2 global batches"):
        ec.check("tokens", ["resume:at=2"])


def test_under_a_launcher_a_resume_is_skipped_saying_why(monkeypatch):
    """A launcher's group is fixed: no fresh processes for a segment, so the row is skipped, never trained in it."""
    from equivcheck.runners.ranks import launcher

    monkeypatch.setattr(launcher, "active", lambda: True)
    (outcome,) = ec.check("tokens", ["resume:at=1"]).outcomes
    assert outcome.verdict is Verdict.SKIPPED and "a launcher's fixed group cannot" in outcome.reason


# --- a team's own checkpoint code ----------------------------------------------------------------------------------

import team_checkpoints as team  # noqa: E402


@pytest.mark.parametrize("after", [None, 1], ids=["same ranks", "2 ranks restored on 1"])
def test_a_teams_own_checkpoint_code_resumes_its_step_exactly(after):
    """The team's save (rank 0's torch.save of the state dicts) and load (every rank), its DDP step resumed after
    one global batch on ranks started afresh, on 2 ranks again or on 1."""
    report = ec.check_step("mlp", team.step, world_size=2,
                           resume=ec.Checkpoint(at=1, save=team.save, load=team.load, world_size=after))
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert outcome.regime.startswith("ddp_step:world_size=2,fn=team_checkpoints:step>resume:at=1,save=")


@pytest.mark.parametrize(("save", "load", "caught_from"), [
    (team.save_model_only, team.load_model_only, 2),  # SGD's momentum restarts: step 1's update, step 2's gradients
    (team.save, team.load_nothing, 1),  # the fresh model trains on: from the resumed step
])
def test_a_teams_checkpoint_that_loses_state_is_caught(save, load, caught_from):
    report = ec.check_step("mlp", team.step, world_size=2, resume=ec.Checkpoint(at=1, save=save, load=load))
    (outcome,) = report.outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 1000, outcome.describe()
    assert outcome.comparison.first_divergent_step == caught_from


def test_a_teams_resume_needs_ranks_and_both_functions():
    with pytest.raises(ec.InvalidArgument, match=r"check_step\(\.\.\., world_size=1\) runs it on a rank"):
        ec.check_step("mlp", team.step, resume=ec.Checkpoint(at=1, save=team.save, load=team.load))
    with pytest.raises(ec.InvalidArgument, match="save='team_checkpoints:save' is not allowed without load="):
        ec.check_step("mlp", team.step, world_size=2, resume=ec.Checkpoint(at=1, save=team.save))
    with pytest.raises(ec.InvalidArgument, match="but got resume=3"):
        ec.check_step("mlp", team.step, world_size=2, resume=3)


def test_the_command_line_reaches_a_teams_checkpoint_code_by_its_spec(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    spec = ("ddp_step:world_size=2,fn=team_checkpoints:step>resume:at=1,save=team_checkpoints:save_model_only,"
            "load=team_checkpoints:load_model_only")
    rows = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "equivcheck", "run", "--case", "mlp", "--regime", spec, "--json",
                          str(rows)], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    assert run.returncode == 1, run.stdout + run.stderr  # a mismatch nobody declared: the gate fails
    (row,) = json.loads(rows.read_text())["rows"]
    assert row["regime"] == spec and row["verdict"] == "mismatch"


@pytest.mark.parametrize(("load", "verdict"), [(team.load_with_position, Verdict.EQUIVALENT),
                                               (team.load_without_position, Verdict.MISMATCH)],
                         ids=["position restored", "position lost"])
def test_a_teams_resumed_loop_skips_what_it_trained_by_its_own_restored_position(load, verdict):
    """The restored loop is handed every global batch, as the uninterrupted one was: skipping the first is its own
    position's work. Lost, the loop trains the first batch again: more optimizer steps than the reference."""
    (outcome,) = ec.check_loop("mlp", team.loop, world_size=2,
                               resume=ec.Checkpoint(at=1, save=team.save_with_position, load=load)).outcomes
    assert outcome.verdict is verdict, outcome.describe()
    if verdict is Verdict.MISMATCH:
        assert "optimizer steps: the reference took 3, the candidate 4" in outcome.describe()


def test_a_gradscalers_state_lost_on_resume_is_caught_where_a_scaler_steps():
    """The scaler's state is compared as buffers are: a resume without it counts its clean steps from zero again
    (caught in float64 through a GradScaler, the mode fp16-autocast's shadows run in, on this CPU); the faithful
    resume restores it; a precision without a scaler skips the pitfall saying so."""
    scaled = "float64-shadow-scaled"
    faithful, lost = ec.check("resume_tokens", ["resume:at=1", "resume_without_scaler:at=1"], dtype=scaled).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()
    assert lost.verdict is Verdict.EXPECTED_MISMATCH, lost.describe()
    assert [m.name for m in lost.comparison.mismatches] == ["GradScaler.growth_tracker"]
    assert "the GradScaler's state differs" in lost.comparison.hint
    (unscaled,) = ec.check("resume_tokens", ["resume_without_scaler:at=1"]).outcomes
    assert unscaled.verdict is Verdict.SKIPPED and "no scaler state to lose" in unscaled.reason


def test_a_run_restarted_twice_goes_on_from_each_checkpoint_in_fresh_processes():
    """Three segments, two checkpoints: DDP on 2 ranks, then FSDP2 on 2, then DDP again; a save that leaves the
    optimizer out at the second restart is caught after it, the first one's steps matching."""
    chain = "ddp:world_size=2>resume:at=1>fsdp:world_size=2>resume:at=2>ddp:world_size=2"
    resumed = ec.parse_regime(chain)
    assert str(resumed) == chain and [link.at for link in resumed.links] == [1, 2]
    assert [str(r) for r in resumed.segments] == ["ddp:world_size=2", "fsdp:world_size=2", "ddp:world_size=2"]
    faithful, lost = ec.check("mlp", [chain, "resume:at=1>resume_without_optimizer:at=2"]).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()
    assert faithful.result.optimizer_steps == 3
    assert lost.verdict is Verdict.MISMATCH and {m.kind for m in lost.comparison.mismatches} == {"weight"}



def test_a_teams_checkpoint_at_several_batches_restarts_the_run_after_each():
    regime = ec.parse_regime("ddp_step:world_size=2,fn=team_checkpoints:step")
    from equivcheck.team import _resumed

    chained = _resumed(regime, ec.Checkpoint(at=(1, 2), save=team.save, load=team.load))
    assert [link.at for link in chained.links] == [1, 2] and len(chained.segments) == 3
    (outcome,) = ec.check("mlp", [chained]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    with pytest.raises(ec.InvalidArgument, match=r"at=\(\) is not allowed"):
        ec.check_step("mlp", team.step, world_size=2, resume=ec.Checkpoint(at=(), save=team.save, load=team.load))
