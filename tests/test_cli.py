"""The command line: the matrix, JSON rows and exit codes (0 as expected, 1 not, 2 usage error)."""

import json
import subprocess
import sys

import pytest

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
    for name in ("mlp", "seed004_linear", "batchnorm_cnn", "accumulate:chunks=K", "naive_accumulate:chunks=K"):
        assert name in out


def test_run_prints_the_matrix_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    code = main(["run", "--case", "mlp", "--case", "batchnorm_cnn", "--regime", "full_batch",
                 "--regime", "accumulate:chunks=5", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    header, rule, *rows = out.splitlines()[:4]
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
    assert {"max_abs", "max_rel", "mismatches", "optimizer_steps"} <= caught.keys()


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
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_works_the_same():
    done = subprocess.run([sys.executable, "-m", "equivcheck", "run", "--case", "seed004_linear"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 checks: 4 equivalent; all as expected" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "equivcheck", "run", "--bogus"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
