"""Torch's warnings raised while a check trains (in the checking process, its isolating child, on ranks) are gathered
by the command, counted in its last line and written to a file beside its report, never printed between its lines;
equivcheck's own warnings and the case's stay where they were (issue 58, item 4)."""

import logging
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.cli import main

from torch_warning_cases import SOFTMAX_WARNING, WARNS

CASES = "torch_warning_cases"  # --cases-from by module name: imported once


@pytest.mark.parametrize("regime, where", [("accumulate:chunks=2", "isolating child"),
                                           ("ddp:world_size=2", "rank 1")])
def test_a_command_counts_torchs_warnings_and_writes_them_beside_its_report(regime, where, tmp_path, capfd):
    report = tmp_path / "report.json"
    code = main(["run", "--cases-from", CASES, "--case", WARNS.name, "--regime", regime, "--json", str(report)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert SOFTMAX_WARNING not in out + err  # not between the report's lines, from this process, a child or a rank
    written = tmp_path / "report.warnings.txt"
    last = out.strip().splitlines()[-1]
    assert f"torch warnings, written to {written}" in last
    count = int(last.split("; ")[-1].split()[0])
    assert count >= 2  # the reference and the regime both warned
    text = written.read_text()
    # attributed as Python attributes it (torch's stacklevel: the case's line), relative to the working folder
    assert SOFTMAX_WARNING in text and "torch_warning_cases.py:19: UserWarning" in text and f"x {where}" in text
    assert str(count) + " torch warnings raised while `equivcheck run` trained" in text


def test_in_process_with_no_isolate_and_an_explicit_path(tmp_path, capfd):
    path = tmp_path / "noise.txt"
    code = main(["run", "--cases-from", CASES, "--case", WARNS.name, "--regime", "accumulate:chunks=2",
                 "--no-isolate", "--warnings", str(path)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert SOFTMAX_WARNING not in out + err
    # once: Python's default filter shows a warning once per place in a process, and --no-isolate trains in one
    assert out.strip().splitlines()[-1].endswith(f"; 1 torch warning, written to {path}")
    assert "x in process" in path.read_text()


def test_equivcheck_s_own_and_the_case_s_warnings_stay_visible():
    from equivcheck.process import torch_output

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch_output.catching() as caught:
            F.softmax(torch.ones(2, 2))  # torch's
            warnings.warn(ec.PrecisionWarning("equivcheck's own"))
            warnings.warn("the case's own", UserWarning)
            logging.getLogger("torch._dynamo").warning("Profiler record function %s will be ignored", "x")
    assert [str(w.message) for w in seen] == ["equivcheck's own", "the case's own"]
    assert [(s.kind, s.category) for s in caught] == [("warning", "UserWarning"), ("log", "torch._dynamo WARNING")]
    assert caught[1].message == "Profiler record function x will be ignored"


def test_the_library_still_shows_them_where_nothing_gathers(capfd):
    """Without a command gathering, a rank's warnings reach standard error once, from the checking process."""
    ec.check(WARNS, ["ddp:world_size=2"]).assert_equivalent()
    err = capfd.readouterr().err
    assert SOFTMAX_WARNING in err
    assert err.count(SOFTMAX_WARNING) == sum("torch_warning_cases.py:19: UserWarning" in line for line in err.splitlines())


def test_nothing_written_where_torch_said_nothing(tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["run", "--case", "mlp", "--regime", "full_batch", "--json", str(report)]) == 0
    assert "torch warning" not in capsys.readouterr().out.strip().splitlines()[-1]
    assert "torch raised no warning" in (tmp_path / "report.warnings.txt").read_text()
    assert os.path.exists(report)
