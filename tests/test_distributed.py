"""Distributed regimes on real process groups (gloo, spawned worker ranks), and their faults."""

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.runners.ranks import forker as forkers
from equivcheck.runners.ranks import pool as pools
from equivcheck.device import auto_backend

import fault_cases  # noqa: F401  (registers the fault_* cases; workers import it by name)
from processes import alive
from equivcheck_cases.seed003_article import ARTICLE_WEIGHTS


@pytest.mark.parametrize("regime", ["full_batch", "accumulate:chunks=2", "ddp:world_size=2",
                                    "ddp_no_sync:world_size=2,chunks=2"])
def test_seed003_article_weights(regime):
    """Both of the article's paths reproduce its printed final weights."""
    result = ec.run("seed003_article", regime)
    torch.testing.assert_close(result.weights["weight"][0], torch.tensor(ARTICLE_WEIGHTS, dtype=torch.float64),
                               rtol=0, atol=5e-5)


def test_no_sync_all_reduces_once_per_step_and_its_twin_every_micro_batch():
    report = ec.check("ddp_sync_every_micro_batch")
    no_sync = report.outcome("ddp_sync_every_micro_batch", "ddp_no_sync:world_size=2,chunks=3")
    every = report.outcome("ddp_sync_every_micro_batch", "ddp_sync_every_micro_batch:world_size=2,chunks=3")
    assert no_sync.verdict is Verdict.EQUIVALENT and no_sync.result.syncs == (1, 1, 1)
    # The 6-10-3 MLP has 103 float64 parameters: one bucket of 824 bytes per all-reduce.
    assert no_sync.result.sync_bytes == (824, 824, 824)
    assert every.result.syncs == (3, 3, 3) and every.result.sync_bytes == (3 * 824,) * 3
    assert every.comparison.margin < 1  # the numbers are right ...
    assert every.verdict is Verdict.EXPECTED_MISMATCH  # ... the communication is not
    assert every.comparison.problems == (
        "communication: step 0 all-reduced gradients 3 time(s) (2472 bytes per rank); a faithful step does it 1 time(s)",)
    # said as what it is: no "not equivalent" over a margin below 1, and the advice names no_sync
    assert every.comparison.describe().startswith("the numbers match (margin ")
    assert "the communication differs" in every.comparison.describe().splitlines()[0]
    assert "model.no_sync()" in every.comparison.hint
    assert no_sync.comparison.hint == ""


def test_ddp_keeps_the_global_mean_with_uneven_shards_and_token_counts():
    report = ec.check("ddp_uneven_shards") + ec.check("ddp_mean_loss_uneven_tokens")
    report.assert_equivalent()
    assert report.outcome("ddp_uneven_shards", "ddp:world_size=2").verdict is Verdict.EQUIVALENT
    for case, regime in [("ddp_uneven_shards", "ddp_mean_loss:world_size=2"),
                         ("ddp_uneven_shards", "ddp_padded_sampler:world_size=2"),
                         ("ddp_mean_loss_uneven_tokens", "ddp_mean_loss:world_size=2")]:
        outcome = report.outcome(case, regime)
        assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 100
        assert outcome.comparison.first_divergent_step == 0
        assert outcome.result.rank_spread == 0  # ranks agree with each other, all wrong together


def test_batchnorm_under_ddp_is_caught():
    outcome = ec.check("batchnorm_cnn", ["ddp:world_size=2"]).outcomes[0]
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH
    assert {"1.weight", "1.bias"} <= {m.name for m in outcome.comparison.mismatches if m.kind == "grad"}


def test_data_parallel_is_skipped_without_two_gpus():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: data_parallel really runs here")
    (outcome,) = ec.check("mlp", ["data_parallel"]).outcomes
    assert outcome.verdict is Verdict.SKIPPED
    assert outcome.reason == f"DataParallel needs at least 2 CUDA devices; {torch.cuda.device_count()} found"
    with pytest.raises(ec.Unavailable):
        ec.run("mlp", "ddp:world_size=2,backend=nccl")


@pytest.mark.parametrize(("available", "count", "reason"), [
    (True, 2, None), (True, 1, "DataParallel needs at least 2 CUDA devices; 1 found"),
    (False, 3, "DataParallel needs at least 2 CUDA devices; 0 found"),  # devices a broken driver cannot use
])
def test_data_parallel_runs_on_two_or_more_usable_gpus_only(monkeypatch, available, count, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert ec.parse_regime("data_parallel").unavailable() == reason


@pytest.mark.parametrize(("available", "count", "words"), [
    (False, 2, "gloo"), (True, 0, "gloo"), (True, 1, "nccl up to 1 rank (a GPU each), gloo beyond"),
    (True, 4, "nccl up to 4 ranks (a GPU each), gloo beyond"),
])
def test_auto_backend_in_words_for_the_gpus_this_machine_can_use(monkeypatch, available, count, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert auto_backend("cuda") == words
    assert auto_backend("cpu") == "gloo"  # a check on the CPU trains its ranks there, whatever GPUs the machine has


def test_data_parallel_wraps_in_nn_data_parallel_with_the_model_on_the_first_gpu():
    regime = ec.parse_regime("data_parallel")
    assert regime.device() == torch.device("cuda", 0)
    model = nn.Linear(2, 2)
    wrapped = regime.wrap(model, None)  # constructible without a GPU: it then keeps the module as it is
    assert isinstance(wrapped, nn.DataParallel) and wrapped.module is model


def test_the_ddp_traps_build_ddp_with_their_option_on():
    assert ec.parse_regime("ddp_no_sync_find_unused:world_size=2").ddp_options() == {"find_unused_parameters": True}
    assert ec.parse_regime("ddp_no_sync_static_graph:world_size=2").ddp_options() == {"static_graph": True}


@pytest.mark.parametrize(
    ("case", "timeout", "message"),
    [
        ("fault_raise", 60, "rank 1 raised RuntimeError: injected fault on rank 1"),
        ("fault_hang", 3, "rank(s) 0, 1 of 2 made no progress for 3 s"),  # rank 0 waits on rank 1
        ("fault_kill", 60, "rank 1 died (killed by SIGKILL)"),
        # The race the line above once lost, made certain: rank 0's error arrives first; the death is named.
        ("fault_late_kill", 60, "rank 1 died (killed by SIGKILL); rank 0 then raised RuntimeError"),
    ],
)
def test_a_faulty_rank_becomes_an_error_and_the_next_job_gets_a_fresh_pool(case, timeout, message):
    warm = pools.pool_for("gloo", 2)
    pids = warm.pids
    # The ranks' first step imports what torch loads lazily (seconds on a busy machine): done here, so that within
    # the hang's 3 s each rank reaches the frame its stack must show
    ec.run("mlp", "ddp:world_size=2")
    started = time.monotonic()
    report = ec.check(case, ["accumulate:chunks=2", "ddp:world_size=2", "accumulate:chunks=3"], timeout=timeout)
    before, crashed, after = report.outcomes
    assert time.monotonic() - started < timeout + 30
    assert (before.verdict, after.verdict) == (Verdict.EQUIVALENT, Verdict.EQUIVALENT)  # nothing computed is lost
    assert crashed.verdict is Verdict.ERROR and message in crashed.reason
    if case == "fault_raise":
        assert "injected fault on rank 1" in crashed.details and "Traceback" in crashed.details
        assert 'fault_cases.py", line' in crashed.details  # the rank's own frames, not the parent's
    if case == "fault_hang":  # each hung rank's stack says where it stands, and the message how to allow more time
        assert "allow more: --timeout SECONDS (equivcheck run), timeout= (ec.check" in crashed.reason
        rank1 = crashed.details.split("rank 1 stack when it timed out:")[1]
        assert "fault_cases.py" in rank1 and "in forward" in rank1
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a rank of the faulty pool outlived it"
    assert ec.check("mlp", ["ddp:world_size=2"]).outcomes[0].verdict is Verdict.EQUIVALENT
    assert pools.pool_for("gloo", 2).pids != pids


def test_a_job_longer_than_its_timeout_whose_ranks_keep_stepping_is_judged_not_called_a_hang():
    """Every rank takes a second a step (fault_slow), three steps, under a 2 s timeout: the timeout measures how long
    the ranks go without progress, not the job's length."""
    ec.run("mlp", "ddp:world_size=2")  # the ranks' first step imports what torch loads lazily: not a step's time
    started = time.monotonic()
    (outcome,) = ec.check("fault_slow", ["ddp:world_size=2"], timeout=2).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    assert time.monotonic() - started > 3  # it did outlast its timeout


def test_workers_exit_when_their_parent_dies(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys
        from equivcheck.runners.ranks.pool import pool_for
        print(*pool_for("gloo", 2).pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup: the ranks are on their own
    """)
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    stdout, _ = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    pids = [int(p) for p in stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10  # the forker looks for its parent every 50 ms, then exits (its teardown too)
    while (any(alive(pid) for pid in pids) or forkers_of(killed.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
    assert not forkers_of(killed.pid), "the forker outlived the process that started it"
    # The parent could not remove its pool's folder; its ranks did, on their way out.
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"{pools.FOLDER_PREFIX}{killed.pid}-*"))


def forkers_of(parent: int) -> list[int]:
    """Live forkers started by ``parent``: their command line ends with its pid."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as file:
                words = file.read().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if forkers.FORKER_COMMAND.encode() in words and words[-1] == str(parent).encode():
            found.append(int(cmdline.split("/")[2]))
    return [pid for pid in found if alive(pid)]


def test_torchrun_runs_the_ddp_regimes_in_the_launchers_group(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "equivcheck", "run", "--case", "seed003_article",
         "--case", "ddp_uneven_shards", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},  # torchrun's own log folders go there
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("checks:") == 1  # rank 0 reports, rank 1 stays quiet
    assert "8 checks: 6 equivalent, 2 expected_mismatch; all as expected" in done.stdout
    import json
    rows = {(r["case"], r["regime"]): r["verdict"] for r in json.loads(out.read_text())["rows"]}
    assert rows[("seed003_article", "ddp:world_size=2")] == "equivalent"
    assert rows[("ddp_uneven_shards", "ddp_padded_sampler:world_size=2")] == "expected_mismatch"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ddp:world_size=13", "world_size=13 is not allowed: expected an integer from 1 to 12"),
        ("ddp_no_sync:world_size=5,chunks=3", "chunks=3 is not allowed: expected an integer from 1 to 2 (the smallest "
                                              "shard of batch_size=12 over world_size=5)"),
        ("ddp:world_size=2,backend=mpi", "backend='mpi' is not allowed: expected one of auto, gloo, nccl"),
        ("ddp:world_size=0", "world_size=0 is not allowed"),
    ],
)
def test_bad_distributed_specs(spec, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.run("mlp", spec)
    assert message in str(raised.value)


def test_unregistered_case_cannot_cross_to_workers():
    import dataclasses

    inline = dataclasses.replace(ec.get_case("mlp"), name="inline_only")
    with pytest.raises(ec.InvalidArgument, match="worker processes import the case by the name it is bound to"):
        ec.run(inline, "ddp:world_size=2")


def test_the_cli_stops_its_ranks_before_it_exits():
    script = textwrap.dedent("""
        from equivcheck.cli import main
        from equivcheck.runners.ranks.pool import pool_for
        from equivcheck.process.exit import exit_without_teardown
        code = main(["run", "--case", "mlp", "--regime", "ddp:world_size=2"])
        print(*pool_for("gloo", 2).pids, flush=True)
        exit_without_teardown(code)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.splitlines()[-1].split()]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)
