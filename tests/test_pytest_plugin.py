"""The pytest plugin, driven the way users drive it: pytest runs inside pytest (pytester)."""

import json
import subprocess
import sys
from pathlib import Path

import _pytest.pytester
import pytest

from equivcheck.cli import main
from equivcheck.device import auto_backend, gpus


@pytest.fixture(autouse=True)
def keep_imported_modules(monkeypatch, tmp_path_factory):
    """pytester drops every module an in-process run imported; torch cannot be imported twice in one
    process (nor its lazily loaded parts), so keep all modules but the tests' own files. Autouse, so
    the patch is in place before the pytester fixture takes its first snapshot."""
    root = str(tmp_path_factory.getbasetemp())
    snapshot = _pytest.pytester.SysModulesSnapshot

    def outside_the_test_files(name):
        return not (getattr(sys.modules.get(name), "__file__", None) or "").startswith(root)

    monkeypatch.setattr(_pytest.pytester, "SysModulesSnapshot",
                        lambda preserve=None: snapshot(preserve=outside_the_test_files))

NAIVE_STEP = '''
import torch.nn.functional as F

def naive_step(model, optimizer, batch, chunks=5):
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
        (F.cross_entropy(model(x), y) / chunks).backward()   # mean / K: chunks of 3,3,2,2,2
    optimizer.step()
    optimizer.zero_grad()
'''

FIXTURE_TESTS = NAIVE_STEP + '''
def test_accumulation_matches(equivcheck):
    report = equivcheck.check("mlp", ["accumulate:chunks=5"])
    assert report.ok

def test_naive_step(equivcheck):
    equivcheck.check_step("mlp", naive_step)
'''


def test_fixture_passes_and_fails_with_equivchecks_description(pytester):
    pytester.makepyfile(test_user=FIXTURE_TESTS)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        f"equivcheck: seed 0, torch *, device cpu, backend {auto_backend()}, dtype per case, world sizes per test",
        "E *NotEquivalent: mlp under step:naive_step: mismatch*",  # the verdict (and where it parts) first
        "*1 of 1 checks failed:*",
        "*mlp under step:naive_step: mismatch*",
        "*grad of '0.weight' mismatched from step 0*",
        "*= equivcheck =*",
        "case*accumulate:chunks=5*step:naive_step",
        "mlp*ok *MISMATCH *",
    ])
    failure = result.stdout.str().split("= FAILURES =")[1]
    assert "checker.py" not in failure and "verdict.py" not in failure  # the plugin's frames hidden


def test_generated_tests_have_readable_ids_and_obey_k(pytester):
    result = pytester.runpytest("--equivcheck-cases", "seed004_linear", "--equivcheck-cases", "batchnorm_cnn",
                                "--collect-only")
    result.stdout.fnmatch_lines([f"equivcheck: seed 0, torch *, device cpu, backend {auto_backend()}, dtype per case, "
                                 "world sizes 1,2 (generated tests)"])
    result = pytester.runpytest("--equivcheck-cases", "seed004_linear", "--collect-only", "-q")
    result.stdout.fnmatch_lines([
        "::test_equivalence[seed004_linear-full_batch]",
        "::test_equivalence[seed004_linear-sample_by_sample]",
        "::test_equivalence[seed004_linear-accumulate:chunks=2]",
        "::test_equivalence[seed004_linear-retained_graph:chunks=2]",
    ])
    result = pytester.runpytest("--equivcheck-cases", "mlp", "--equivcheck-cases", "batchnorm_cnn",
                                "--equivcheck-regimes", "accumulate:chunks=5", "-k", "batchnorm", "-v")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_equivalence[[]batchnorm_cnn-accumulate:chunks=5[]] PASSED*",
                                 "batchnorm_cnn*caught *"])


def test_a_generated_test_whose_regime_cannot_run_its_case_is_skipped_saying_why(pytester):
    result = pytester.runpytest("--equivcheck-cases", "batchnorm_cnn", "--equivcheck-cases", "gru_detached_hidden",
                                "--equivcheck-regimes", "per_token:detach=1", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*regime 'per_token:detach=1' on case 'batchnorm_cnn': the case's trunk "
                                 "Sequential has no initial_hidden()*"])


MISSPELT_KEYWORD = """
import pytest

@pytest.mark.equivcheck(timout=3)
def test_gate(equivcheck):
    equivcheck.check("mlp", ["accumulate:chunks=4"])
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
@pytest.mark.parametrize(("args", "files", "message"), [
    (["--equivcheck-cases", "nosuchcase", "--equivcheck-regimes", "ddp:world_size=2"], {},
     "ERROR: equivcheck: unknown case 'nosuchcase'; known cases: adamw8bit_local_size, adamw8bit_mlp, batchnorm_cnn,*"),
    ([], {"test_misspelt": MISSPELT_KEYWORD},
     "ERROR: test_misspelt.py::test_gate: unknown @pytest.mark.equivcheck keyword 'timout'; allowed keywords:*"),
])
def test_a_usage_error_met_at_collection_stops_the_run_with_or_without_xdist(pytester, workers, args, files, message):
    """Under -n the workers collect and the controller collects nothing: a worker hands its usage error over and the
    controller ends the session with it (exit 4), instead of 'no tests ran' (exit 5) or an internal error."""
    if files:
        pytester.makepyfile(**files)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", *workers, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


USER_CASES = '''
import dataclasses
import equivcheck as ec

ec.register_case(dataclasses.replace(ec.get_case("mlp"), name="wrongly_trusted", expect_mismatch={},
                                     regimes=("accumulate:chunks=5", "naive_accumulate:chunks=5")))
'''


def test_generated_failure_shows_the_mismatch_not_a_traceback_and_json_matches_the_cli(pytester, isolated_registry):
    pytester.makepyfile(my_cases=USER_CASES)
    cli_out, out = pytester.path / "cli.json", pytester.path / "rows.json"
    assert main(["run", "--cases-from", "my_cases.py", "--case", "wrongly_trusted", "--json", str(cli_out)]) == 1
    result = pytester.runpytest("--equivcheck-cases-from", "my_cases.py", "--equivcheck-cases", "wrongly_trusted",
                                "--equivcheck-json", str(out))
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*wrongly_trusted under naive_accumulate:chunks=5: mismatch*",
                                 "*grad of '2.weight' mismatched from step 0*"])
    result.stdout.no_fnmatch_line("*Traceback*")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["regime"], r["verdict"]) for r in rows] == [
        ("wrongly_trusted", "accumulate:chunks=5", "equivalent"),
        ("wrongly_trusted", "naive_accumulate:chunks=5", "mismatch")]
    assert rows[1]["margin"] > 100 and rows[1]["first_divergent_step"] == 0
    cli_rows = json.loads(cli_out.read_text())["rows"]
    assert [{**r, "seconds": 0} for r in cli_rows] == [{**r, "seconds": 0} for r in rows]


def test_the_plugin_offers_the_public_precision_modes_only():
    """Written out in the plugin so that loading it imports no torch; the float64 shadows are equivcheck's own."""
    from equivcheck.precision import PUBLIC_PRECISIONS, SCALED_SHADOW, SHADOW
    from pytest_equivcheck.options import DTYPES, MARKER_HELP

    assert DTYPES == PUBLIC_PRECISIONS
    assert SHADOW not in DTYPES and SCALED_SHADOW not in DTYPES
    assert all(repr(dtype) in MARKER_HELP for dtype in DTYPES) and SHADOW not in MARKER_HELP


ONE_SPEC_AS_A_STRING = """
import equivcheck as ec

def test_one_spec(equivcheck):
    (outcome,) = equivcheck.check("mlp", "accumulate:chunks=4").outcomes
    assert (outcome.regime, outcome.verdict) == ("accumulate:chunks=4", ec.Verdict.EQUIVALENT)

def test_one_regime_object(equivcheck):
    (outcome,) = equivcheck.check("mlp", ec.parse_regime("accumulate:chunks=3")).outcomes
    assert outcome.regime == "accumulate:chunks=3"

def test_the_same_as_the_library(equivcheck):
    fixture = equivcheck.check("mlp", "sample_by_sample")
    library = ec.check("mlp", "sample_by_sample")
    assert [(o.regime, o.verdict) for o in fixture.outcomes] == [(o.regime, o.verdict) for o in library.outcomes]

def test_a_misspelt_spec_is_named_whole(equivcheck):
    try:
        equivcheck.check("mlp", "acumulate:chunks=4")
    except ec.InvalidArgument as error:
        assert "unknown regime 'acumulate'" in str(error), error
    else:
        raise AssertionError("no error")
"""


def test_the_fixture_takes_one_regime_given_alone_as_ec_check_does(pytester):
    """``equivcheck.check("mlp", "accumulate:chunks=4")`` is that one regime, never its characters one by one."""
    pytester.makepyfile(test_one_spec=ONE_SPEC_AS_A_STRING)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=4)
    assert "unknown regime 'a'" not in result.stdout.str()


@pytest.mark.filterwarnings("default::equivcheck.EquivcheckWarning")  # this suite ignores BlindSpotWarning (pyproject)
def test_one_warning_filter_makes_every_equivcheck_warning_an_error(pytester):
    """seed004_linear holds one item per sample: check_step warns that a normalisation bug cannot show; one filter on
    the base makes that warning, as every other, an error."""
    pytester.makepyfile(test_warned="""
import equivcheck as ec

def mean_step(model, optimizer, batch):
    inputs, targets = batch
    ec.get_case("seed004_linear").loss(model(inputs), targets).mean().backward()
    optimizer.step()
    optimizer.zero_grad()

def test_blind(equivcheck):
    equivcheck.check_step("seed004_linear", mean_step)
""")
    warned = pytester.runpytest("-p", "no:randomly")
    warned.assert_outcomes(passed=1)  # pytest's own warnings (assertion rewriting under an editable install) aside:
    assert warned.stdout.str().count("BlindSpotWarning: ") == 1  # equivcheck's one warning, shown
    result = pytester.runpytest("-p", "no:randomly", "-W", "error::equivcheck.EquivcheckWarning")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*BlindSpotWarning: *every sample holds the same number of items*"])


def test_marker_keywords_set_the_fixtures_defaults(pytester):
    pytester.makepyfile(test_marked='''
import pytest, torch

@pytest.mark.equivcheck(dtype="float32", seed=3)
def test_float32(equivcheck):
    (outcome,) = equivcheck.check("mlp", ["accumulate:chunks=5"]).outcomes
    assert outcome.result.weights["0.weight"].dtype == torch.float32
    assert outcome.comparison.tolerance.rtol == 1.3e-6

@pytest.mark.equivcheck(rtol=1.0, atol=1.0)
def test_wide_tolerance_hides_the_pitfall(equivcheck):
    equivcheck.check("naive_scaling_uneven_chunks", ["naive_accumulate:chunks=5"])
''')
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*naive_accumulate:chunks=5: unexpected_match*"])


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("rtoll=1e-3", "unknown @pytest.mark.equivcheck keyword 'rtoll'; allowed keywords: reference, rtol, atol,"),
        ("'mlp'", "@pytest.mark.equivcheck takes keywords only, got positional ('mlp',)"),
        ("rtol=1e-3", "@pytest.mark.equivcheck rtol=0.001 is not allowed: expected rtol and atol given together"),
        ("dtype='float16'", "@pytest.mark.equivcheck dtype='float16' is not allowed: expected 'float64' or 'float32'"),
        # equivcheck's own float64 shadows, run beside a low-precision check, are not a mode to ask for
        ("dtype='float64-shadow'", "@pytest.mark.equivcheck dtype='float64-shadow' is not allowed: expected 'float64' or "
                                   "'float32' or 'bf16-autocast' or 'fp16-autocast' or 'bf16' or 'bf16-master'"),
        ("dtype='float64-shadow-scaled'", "@pytest.mark.equivcheck dtype='float64-shadow-scaled' is not allowed"),
        ("timeout=0", "@pytest.mark.equivcheck timeout=0 is not allowed: expected a finite number of seconds > 0"),
        ("timeout=float('inf')", "@pytest.mark.equivcheck timeout=inf is not allowed: expected a finite number"),
        ("rtol=float('inf'), atol=float('inf')", "@pytest.mark.equivcheck rtol=inf is not allowed: expected a finite number"),
        ("seed=-1", "@pytest.mark.equivcheck seed=-1 is not allowed: expected an integer from 0 to 4294967295"),
        ("seed=2**70", "@pytest.mark.equivcheck seed=1180591620717411303424 is not allowed"),
    ],
)
def test_marker_mistakes_are_usage_errors(pytester, marker, message):
    pytester.makepyfile(test_bad=f"import pytest\n\n@pytest.mark.equivcheck({marker})\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*test_bad.py::test_x: {message}*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--equivcheck-regimes", "acumulate:chunks=2"], "equivcheck: unknown regime 'acumulate'; known"),
        (["--equivcheck-regimes", "accumulate:chunks=0"], "equivcheck: chunks=0 is not allowed"),
        (["--equivcheck-cases", "mpl"], "equivcheck: unknown case 'mpl'; known cases: adamw8bit_local_size, adamw8bit_mlp, batchnorm_cnn, "),
        (["--equivcheck-cases-from", "no_such_module_xyz", "--equivcheck-cases", "all"], "cases_from='no_such_module_xyz'"),
        (["--equivcheck-rtol", "0.1"], "--equivcheck-rtol=0.1 is not allowed: expected rtol and atol given together"),
        (["--equivcheck-timeout", "-1"], "--equivcheck-timeout=-1.0 is not allowed: expected a finite number of seconds > 0"),
        (["--equivcheck-dtype", "float16"], "--equivcheck-dtype: invalid choice: 'float16'"),
        (["--equivcheck-dtype", "float64-shadow"], "--equivcheck-dtype: invalid choice: 'float64-shadow' (choose from "
                                                   "'float64', 'float32', 'bf16-autocast', 'fp16-autocast', 'bf16', 'bf16-master')"),
        (["--equivcheck-dtype", "float64-shadow-scaled"], "--equivcheck-dtype: invalid choice: 'float64-shadow-scaled'"),
        (["--equivcheck-timeout", "inf"], "--equivcheck-timeout=inf is not allowed: expected a finite number"),
        (["--equivcheck-rtol", "inf", "--equivcheck-atol", "inf"], "--equivcheck-rtol=inf is not allowed"),
        (["--equivcheck-json", "/no/such/folder/rows.json"], "--equivcheck-json='/no/such/folder/rows.json' is not "
                                                             "allowed: expected a path in an existing folder"),
        (["--equivcheck-regimes", "accumulate:chunks=1000"], "--equivcheck-regimes: regime 'accumulate:chunks=1000' fits "
                                                             "none of the cases asked for: regime 'accumulate:chunks=1000'"
                                                             " on case"),
        (["--equivcheck-regimes", "ddp:world_size=64"], "--equivcheck-regimes: regime 'ddp:world_size=64' fits none of "
                                                        "the cases asked for"),
        (["--equivcheck-regimes", "accumulate:chunks=2,chunks=3"], "chunks is given twice"),
    ],
)
def test_option_mistakes_are_usage_errors(pytester, args, message):
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


@pytest.mark.parametrize(("source", "message"), [
    ("x = (\n", "bad_cases.py:1: SyntaxError: '(' was never closed"),
    ("import equivcheck\nx = 1 / 0\n", "bad_cases.py:2: ZeroDivisionError: division by zero"),
    ("import no_such_package_xyz\n", "bad_cases.py:1: ModuleNotFoundError: No module named 'no_such_package_xyz'"),
    # A team script with no main guard exits while it is imported: no case registered, never a green run.
    ("import sys\ndef main():\n    return 0\nsys.exit(main())\n", "bad_cases.py:4: SystemExit(0): the module exits"),
    ("raise KeyboardInterrupt\n", "bad_cases.py:1: KeyboardInterrupt"),
])
def test_a_cases_from_file_that_cannot_be_imported_is_a_usage_error(pytester, source, message):
    pytester.makepyfile(bad_cases=source)
    result = pytester.runpytest("--equivcheck-cases-from", "bad_cases.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*equivcheck: cases_from='bad_cases.py' could not be imported: *{message}*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def slow_forward(seconds: float) -> str:
    """A test module's head: case SLOW, the mlp whose every forward sleeps ``seconds``."""
    return f'''
import dataclasses, time
import pytest, torch
import equivcheck as ec

class Slow(torch.nn.Linear):
    def forward(self, x):
        time.sleep({seconds})
        return super().forward(x)

SLOW = dataclasses.replace(ec.get_case("mlp"), name="slow", model=lambda: Slow(6, 3), split=None)
'''


def test_a_check_past_its_timeout_fails(pytester):
    pytester.makepyfile(test_slow=slow_forward(0.2) + '''

@pytest.mark.equivcheck(timeout=0.1)
def test_slow(equivcheck):
    equivcheck.check(SLOW, ["full_batch"])

def test_fast(equivcheck):
    equivcheck.check("mlp", ["full_batch"])
''')
    result = pytester.runpytest("--equivcheck-timeout", "60")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*CheckTimeout: check of *slow* made no progress for timeout=0.1 s*"])


def test_a_check_longer_than_its_timeout_that_keeps_stepping_passes(pytester):
    """The alarm measures silence: a forward of 0.5 s a step, each run of three steps longer than its 1 s timeout, in this
    process and in the isolating child alike."""
    pytester.makepyfile(test_long=slow_forward(0.5) + '''

@pytest.mark.equivcheck(timeout=1.0, isolate=False)
def test_long_here(equivcheck):
    started = time.monotonic()
    equivcheck.check(SLOW, ["full_batch"])
    assert time.monotonic() - started > 1.5  # it outlasted its timeout

@pytest.mark.equivcheck(timeout=1.0)
def test_long_in_the_child(equivcheck):
    started = time.monotonic()
    equivcheck.check(SLOW, ["full_batch"])
    assert time.monotonic() - started > 1.5  # it outlasted its timeout
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


SLOW_TO_BUILD = '''
import dataclasses, time
import pytest, torch
import equivcheck as ec

class SlowToBuild(torch.nn.Linear):
    def __init__(self):
        time.sleep(0.3)
        super().__init__(6, 3)

SLOW = dataclasses.replace(ec.get_case("mlp"), name="slow_to_build", model=SlowToBuild, split=None)

@pytest.mark.equivcheck(timeout=0.1)
def test_slow(equivcheck):
    equivcheck.check(SLOW, ["full_batch"])
'''


def test_a_timeout_that_lands_where_the_check_catches_errors_still_fails_it(pytester):
    """The alarm may fire anywhere: in a model built to read its size (whose errors the check forgives), in a run
    (whose errors become verdicts). A CheckTimeout is no Exception, so none of those handlers swallows it."""
    pytester.makepyfile(test_slow_model=SLOW_TO_BUILD)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*CheckTimeout: check of *slow_to_build* made no progress for timeout=0.1 s*"])


def test_loading_the_plugin_imports_no_torch():
    code = "import sys, pytest_equivcheck; assert 'torch' not in sys.modules and 'equivcheck' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_xdist_two_workers_give_the_same_verdicts_and_one_matrix(pytester):
    pytester.makepyfile(test_user=FIXTURE_TESTS)
    args = ("--equivcheck-cases", "batchnorm_cnn", "-p", "no:cacheprovider")
    serial_json, parallel_json = pytester.path / "n0.json", pytester.path / "n2.json"
    serial = pytester.runpytest(*args, "--equivcheck-json", str(serial_json))
    html_path, markdown_path = pytester.path / "report.html", pytester.path / "summary.md"
    parallel = pytester.runpytest(*args, "-n", "2", "--equivcheck-json", str(parallel_json),
                                  f"--equivcheck-html={html_path}", f"--equivcheck-markdown={markdown_path}",
                                  "--equivcheck-plots=all")
    # batchnorm_cnn's 8 regimes include ddp and ddp_no_sync (on each xdist worker's own pool) and
    # data_parallel, skipped without 2 GPUs.
    serial.assert_outcomes(passed=8, failed=1, skipped=1)
    parallel.assert_outcomes(passed=8, failed=1, skipped=1)
    for run in (serial, parallel):  # one matrix, in collection order, however the workers finished
        run.stdout.fnmatch_lines(["*= equivcheck =*", "case*accumulate:chunks=5*step:naive_step*full_batch*sample_by_sample*",
                                  "mlp*ok *MISMATCH *", "batchnorm_cnn*caught * . *ok *caught *ok *",
                                  "case*detached_partial:chunks=5*ddp:world_size=2*ddp_no_sync*data_parallel",
                                  "batchnorm_cnn*ok *caught *caught *skipped"])

    def verdicts(path):
        return sorted((r["case"], r["regime"], r["verdict"], r["first_divergent_step"]) for r in json.loads(path.read_text())["rows"])

    assert verdicts(parallel_json) == verdicts(serial_json) and len(verdicts(serial_json)) == 10
    # one HTML report and one Markdown summary from the controller, with every worker's checks in them
    # a warning points at the user's own line, not at the fixture's code (shown by the workers: in-process, the
    # outer session's filter hides it)
    parallel.stdout.fnmatch_lines(["*test_user.py:*: BlindSpotWarning: case 'mlp' cannot catch*"])
    page = html_path.read_text()
    assert "<h3>mlp under step:naive_step: mismatch</h3>" in page and "<td>ddp_no_sync:world_size=2,chunks=3</td>" in page
    assert f"title='DataParallel needs at least 2 CUDA devices; {gpus()} found'>skipped</td>" in page
    assert "<h2 id='caught-pitfalls'>Caught pitfalls</h2>" in page  # --equivcheck-plots=all
    assert "<h3>batchnorm_cnn under sample_by_sample: expected_mismatch</h3>" in page
    markdown = markdown_path.read_text()
    assert markdown.startswith("## equivcheck (pytest): not as expected\n")
    assert "| mlp | 1 ok, 1 MISMATCH | MISMATCH step:naive_step 4e+05 |" in markdown
    assert "| batchnorm_cnn | 3 ok, 4 caught, 1 skipped | sample_by_sample 3e+06; accumulate:chunks=5 2e+06; " \
           "ddp:world_size=2 1e+06; ddp_no_sync:world_size=2,chunks=3 2e+06 |" in markdown


MYPROJECT_MODEL = '''
import torch, torch.nn.functional as F
from torch import nn

def make_model():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

def make_data():
    return torch.randn(36, 5), torch.randint(0, 3, (36,))

def loss_per_item(output, target):
    return F.cross_entropy(output, target, reduction="none")
'''

MYPROJECT_TRAIN = '''
import contextlib
import torch.nn.functional as F

def train_step(model, optimizer, batch, micro_batches=5):
    inputs, targets = batch
    chunks = list(zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)))
    for i, (x, y) in enumerate(chunks):  # under DDP, one all-reduce: on the last micro-batch
        last = i == len(chunks) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if last else model.no_sync():
            loss = F.cross_entropy(model(x), y, reduction="{reduction}"){scale}
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
'''

# the README's sentence that follows its CI example: the same check on DDP ranks
README_ON_RANKS = "`equivcheck.check_step(CASE, train_step, world_size=2)`"


@pytest.mark.parametrize("on_ranks", [False, True], ids=["in_process", "on_2_ranks"])
@pytest.mark.parametrize(("reduction", "scale", "passes"), [("sum", " / len(targets)", True),
                                                            ("mean", " / micro_batches", False)])
def test_the_readme_ci_gate_runs_as_written(pytester, monkeypatch, reduction, scale, passes, on_ranks):
    """The README's test file as written (its case defined at the top level, not registered); on ranks with the
    README's next sentence in place of its check, in a pytest of its own (warm ranks keep the modules they imported,
    and each parameter writes another myproject)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    snippet = readme.split("<!-- ci-gate -->\n```python\n", 1)[1].split("```", 1)[0]
    assert len(snippet.strip().splitlines()) <= 10
    if on_ranks:
        assert README_ON_RANKS in readme
        snippet = snippet.replace("equivcheck.check_step(CASE, train_step)", README_ON_RANKS.strip("`"))
        assert README_ON_RANKS.strip("`") in snippet
    pytester.mkpydir("myproject")
    pytester.path.joinpath("myproject", "model.py").write_text(MYPROJECT_MODEL)
    pytester.path.joinpath("myproject", "train.py").write_text(MYPROJECT_TRAIN.format(reduction=reduction, scale=scale))
    pytester.mkdir("tests").joinpath("test_train_step.py").write_text(snippet)
    pytester.syspathinsert()
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    run = pytester.runpytest_subprocess if on_ranks else pytester.runpytest
    result = run("tests/test_train_step.py")
    regime = "ddp_step:world_size=2,fn=myproject.train:train_step" if on_ranks else "step:train_step"
    if passes:
        result.assert_outcomes(passed=1)
    else:  # the naive mean / K over micro-batches of 3,3,2,2,2 samples (1,1,1,1,2 per rank)
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([f"*myproject under {regime}: mismatch*",
                                     "*grad of '0.weight' mismatched from step 0*"])


def test_cases_from_reach_the_fixture_without_generating_tests(pytester, isolated_registry):
    pytester.makepyfile(my_cases=USER_CASES, test_named='''
def test_by_name(equivcheck):
    equivcheck.check("wrongly_trusted", ["accumulate:chunks=5"])
''')
    result = pytester.runpytest("--equivcheck-cases-from", "my_cases.py", "test_named.py")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("entry", ["check_step", "check_loop"])
def test_a_team_check_on_ranks_is_bounded_by_its_pool_and_in_process_by_the_alarm(monkeypatch, entry):
    """An alarm could interrupt a distributed job half-way; the pool bounds it and tears itself down cleanly."""
    import contextlib
    from types import SimpleNamespace

    import equivcheck as ec
    from pytest_equivcheck import checker

    bounds = []
    monkeypatch.setattr(checker, "deadline", lambda seconds, what: bounds.append(seconds) or contextlib.nullcontext())
    monkeypatch.setattr(ec, entry, lambda *args, **kwargs: ec.Report(()))
    check = getattr(checker.Checker(SimpleNamespace(user_properties=[]), {"timeout": 5}), entry)
    check("mlp", print, world_size=2)
    check("mlp", print)
    assert bounds == [None, 5]


def test_the_fixture_checks_a_teams_step_on_a_mesh(pytester):
    pytester.makepyfile(test_mesh='''
import mesh_team


def test_tp_step(equivcheck):
    equivcheck.check_step("tp_mlp", mesh_team.train_step, mesh={"tp": 2}, parallelize=mesh_team.tensor_parallel)


def test_tp_bug(equivcheck):
    equivcheck.check_step("tp_mlp", mesh_team.train_step_divided_by_tp, mesh={"tp": 2},
                          parallelize=mesh_team.tensor_parallel)
''')
    # Each check takes over 3 s here (ranks started, two jobs, the replays that locate the bug): an alarm of 2 s would
    # cut it, while the pool's bound of 2 s on each job holds under a busy neighbour (0.5 s did not, once)
    result = pytester.runpytest("-p", "no:cacheprovider", "--equivcheck-timeout", "2")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*mesh_step:fn=mesh_team:train_step_divided_by_tp,parallelizer=mesh_team:tensor_parallel,tp=2: mismatch*"])
