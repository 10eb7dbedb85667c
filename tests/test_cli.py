"""The command line: the matrix, JSON rows and exit codes (0 as expected, 1 not, 2 usage error)."""

import json
import subprocess
import sys

import pytest
import torch

from equivcheck.cli import main

USER_CASES = '''
import dataclasses
import equivcheck as ec

ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="user_bn_free_wrongly_trusted",
    expect_mismatch={}, regimes=("full_batch", "naive_accumulate:chunks=5"),
))
'''


def test_list_shows_cases_and_regimes(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("mlp", "seed004_linear", "batchnorm_cnn", "accumulate:chunks=N[,max_norm=inf]", "naive_accumulate:chunks=N",
                 "ddp:world_size=N[,backend=auto,", "ddp_hook:world_size=N,hook=NAME[,"):
        assert name in out
    # Each option by its type (N, X, NAME, 0|1) or, where it has one, its default; never all alike.
    assert "=K" not in out


def test_run_prints_an_overview_and_only_on_request_the_matrix(capsys):
    args = ["run", "--case", "mlp", "--case", "batchnorm_cnn", "--regime", "full_batch", "--regime", "accumulate:chunks=5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header, rule, mlp, batchnorm = out.splitlines()[:4]
    assert header.split()[:2] == ["case", "verdicts"]
    assert mlp.split() == ["mlp", "2", "ok", "-"]
    assert batchnorm.split() == ["batchnorm_cnn", "1", "ok,", "1", "caught", "accumulate:chunks=5", "2e+06"]
    assert "full_batch  accumulate:chunks=5" not in out and "full matrix: equivcheck run --matrix" in out
    assert main([*args, "--matrix"]) == 0
    assert "case           full_batch  accumulate:chunks=5" in capsys.readouterr().out


def test_run_with_matrix_prints_the_matrix_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    code = main(["run", "--case", "mlp", "--case", "batchnorm_cnn", "--regime", "full_batch",
                 "--regime", "accumulate:chunks=5", "--json", str(path), "--matrix"])
    out = capsys.readouterr().out
    assert code == 0
    header, rule, *rows = out.split("\n\n")[1].splitlines()[:4]
    assert header.split() == ["case", "full_batch", "accumulate:chunks=5"]
    assert rows[0].split()[:4] == ["mlp", "ok", "0e+00", "ok"]
    assert rows[1].split()[3] == "caught"
    assert "4 checks: 3 equivalent, 1 expected_mismatch; all as expected" in out
    records = json.loads(path.read_text())["rows"]
    assert [(r["case"], r["regime"], r["verdict"]) for r in records] == [
        ("mlp", "full_batch", "equivalent"), ("mlp", "accumulate:chunks=5", "equivalent"),
        ("batchnorm_cnn", "full_batch", "equivalent"), ("batchnorm_cnn", "accumulate:chunks=5", "expected_mismatch"),
    ]
    caught = records[3]
    assert caught["margin"] > 100 and caught["first_divergent_step"] == 0 and caught["reason"]
    assert {"max_abs", "max_rel", "mismatches", "optimizer_steps", "syncs"} <= caught.keys()


def test_unexpected_verdict_exits_1_and_explains(tmp_path, capsys):
    source = tmp_path / "my_cases.py"
    source.write_text(USER_CASES)
    code = main(["run", "--cases-from", str(source), "--case", "user_bn_free_wrongly_trusted"])
    out = capsys.readouterr().out
    assert code == 1
    assert "MISMATCH" in out
    assert "FAILED user_bn_free_wrongly_trusted under naive_accumulate:chunks=5: mismatch" in out
    assert "grad of '0.weight' mismatched from step 0" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--case", "nope"], "unknown case 'nope'; known cases:"),
        (["run", "--case", "mlp", "--regime", "accumulate:chunks=0"], "chunks=0 is not allowed"),
        (["run", "--case", "mlp", "--rtol", "1e-3"], "rtol and atol given together"),
        (["run", "--cases-from", "missing_module_xyz"], "cases_from='missing_module_xyz'"),
        (["run", "--case", "mlp", "--rtol", "inf", "--atol", "inf"], "rtol=inf is not allowed: expected a finite number"),
        (["run", "--case", "mlp", "--timeout", "inf"], "timeout=inf is not allowed: expected a finite number > 0"),
        (["run", "--case", "mlp", "--regime", "accumulate:chunks=2,chunks=3"], "chunks is given twice"),
        (["run", "--case", "mlp", "--json", "/no/such/folder/rows.json"],
         "--json='/no/such/folder/rows.json' is not allowed: expected a file that can be written (No such file"),
        (["catalogue", "--json", "/no/such/folder/rows.json"], "--json='/no/such/folder/rows.json' is not allowed"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["run", "--case", "mlp", "--dtype", "float64-shadow"],
    ["run", "--case", "mlp", "--dtype", "float64-shadow-scaled"],
    ["catalogue", "--dtype", "float64-shadow"],
    ["catalogue", "--dtype", "float32", "--dtype", "float64-shadow-scaled"],
])
def test_dtype_offers_the_public_precision_modes_only(argv, capsys):
    """The float64 shadows are equivcheck's own (run beside a low-precision check to tell rounding from a bug):
    asking for one is a usage error that names the modes there are."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --dtype: invalid choice: {argv[-1]!r}" in err
    assert "(choose from 'float64', 'float32', 'bf16-autocast', 'fp16-autocast', 'bf16', 'bf16-master')" in err


@pytest.mark.parametrize(("source", "message"), [
    ("x = (\n", "bad_cases.py:1: SyntaxError: '(' was never closed"),
    ("import equivcheck\nx = 1 / 0\n", "bad_cases.py:2: ZeroDivisionError: division by zero"),
    ("import no_such_package_xyz\n", "bad_cases.py:1: ModuleNotFoundError: No module named 'no_such_package_xyz'"),
    # A team script with no main guard exits while it is imported (sys.exit(main()), argparse's --help): before,
    # the command exited 0, printing nothing and writing no JSON.
    ("import sys\ndef main():\n    return 0\nsys.exit(main())\n", "bad_cases.py:4: SystemExit(0): the module exits"),
    ("import argparse\nargparse.ArgumentParser().parse_args(['--help'])\n", "bad_cases.py:2: SystemExit(0)"),
    ("raise KeyboardInterrupt\n", "bad_cases.py:1: KeyboardInterrupt"),
])
def test_a_cases_from_file_that_cannot_be_imported_exits_2_naming_file_and_line(tmp_path, capsys, source, message):
    bad = tmp_path / "bad_cases.py"
    bad.write_text(source)
    assert main(["run", "--cases-from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"cases_from={str(bad)!r} could not be imported: {tmp_path}/{message}" in err
    assert "Traceback" not in err


def test_a_regime_that_fits_only_some_of_the_cases_is_skipped_where_it_cannot_run(tmp_path, capsys):
    """per_token needs a trunk that steps one token: batchnorm_cnn has none (seen on its model built on the meta
    device, before anything trains), gru_detached_hidden has one. A regime that fits none is still a usage error."""
    path = tmp_path / "rows.json"
    code = main(["run", "--case", "batchnorm_cnn", "--case", "gru_detached_hidden", "--regime", "per_token:detach=1",
                 "--json", str(path)])
    assert code == 0
    rows = {row["case"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["batchnorm_cnn"]["verdict"] == "skipped"
    assert rows["batchnorm_cnn"]["reason"] == (
        "does not fit this case: regime 'per_token:detach=1' on case 'batchnorm_cnn': the case's trunk Sequential has "
        "no initial_hidden(): expected initial_hidden(inputs) and step(inputs[:, t], hidden)")
    assert rows["gru_detached_hidden"]["verdict"] == "expected_mismatch"
    capsys.readouterr()
    assert main(["run", "--case", "batchnorm_cnn", "--case", "mlp", "--regime", "per_token:detach=1"]) == 2
    assert ("regime 'per_token:detach=1' fits none of the cases asked for: regime 'per_token:detach=1' on case "
            "'batchnorm_cnn': the case's trunk Sequential has no initial_hidden()") in capsys.readouterr().err


def test_a_run_that_errored_exits_3_and_its_json_says_so(tmp_path, capsys):
    import fault_cases  # noqa: F401  (registers fault_raise: rank 1 raises inside DDP)

    path = tmp_path / "rows.json"
    code = main(["run", "--case", "fault_raise", "--regime", "accumulate:chunks=2", "--regime", "ddp:world_size=2",
                 "--json", str(path)])
    assert code == 3
    document = json.loads(path.read_text())
    assert document["status"] == "error" and document["interrupted"] is False
    assert [r["verdict"] for r in document["rows"]] == ["equivalent", "error"]
    assert "rank 1 raised RuntimeError: injected fault on rank 1" in document["rows"][1]["reason"]


def test_a_mismatch_outranks_an_error_in_the_exit_code():
    import fault_cases  # noqa: F401

    # mlp under naive_accumulate: a finding (exit 1); fault_raise under ddp: an error (exit 3 alone)
    code = main(["run", "--case", "mlp", "--case", "fault_raise", "--regime", "naive_accumulate:chunks=5",
                 "--regime", "ddp:world_size=2"])
    assert code == 1


def test_nothing_checked_exits_5_with_the_reason(capsys):
    code = main(["run", "--case", "mlp", "--regime", "ddp:world_size=2", "--backend", "nccl"])
    out = capsys.readouterr().out
    if code != 5:
        pytest.skip("this machine has GPUs for nccl: the check ran")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"skipped: nccl needs one CUDA device per rank: 2 asked, {found} found" in out
    assert "1 checks: 1 skipped; nothing was checked: every check was skipped" in out


def test_python_dash_m_works_the_same():
    done = subprocess.run([sys.executable, "-m", "equivcheck", "run", "--case", "seed004_linear"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 checks: 4 equivalent; all as expected" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "equivcheck", "run", "--bogus"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`equivcheck list | head`: the pipe closes before the command writes; no traceback, the shell's 141."""
    process = subprocess.Popen([sys.executable, "-m", "equivcheck", "list"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the first line is written
    errors = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and "Traceback" not in errors and "BrokenPipe" not in errors


def test_the_catalogue_measures_the_entries_on_the_cases_named_and_refuses_a_case_it_does_not_use(capsys):
    assert main(["catalogue", "--dtype", "float64", "--case", "tp_mlp", "--no-isolate"]) == 0
    out = capsys.readouterr().out
    assert "3 rows (3 pitfalls x 1 precisions); every target met" in out
    assert "tensor parallelism: the loss scaled by the TP size" in out and "BatchNorm" not in out
    assert main(["catalogue", "--case", "mlp"]) == 2
    assert "case='mlp' is not allowed: expected a case the catalogue uses: batchnorm_cnn," in capsys.readouterr().err
