"""The field (equivcheck/suites/field.py, cases/field/): every publicly reported bug caught as reported and equivalent as
fixed, each module citing its report; the runner's own guards; the README's totals as the command prints them."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import equivcheck as ec
from equivcheck.suites import field
from equivcheck.suites.field import Bug, Finding

MODULES = field.modules()
README = Path(__file__).resolve().parent.parent / "README.md"


# The caught rows not located where their fix acts (issue 56), each with what it was located as: every other caught row
# that declares where its fix acts is located there, and these are not (a row that comes right is taken off).
NOT_WHERE_THE_FIX_ACTS = {
    "transformers_48687": "unsaid: the experts' parts of their input gradient are not told apart from a reduction's; "
                          "the fix acts at backward experts",
    "megatron_lm_2121": "located at forward; the fix acts at loss",
    "open_unlearning_178": "unsaid: the block ran inside a reentrant checkpoint's forward, which keeps no graph of its "
                           "modules to read back; the fix acts at backward",
    "megatron_bridge_5963": "unsaid, as open_unlearning_178's: a block recomputed reentrant; the fix acts at backward",
    "megatron_bridge_5900": "located at forward, the model's output: its Megatron form hands its children chunks of the "
                            "sequence on [sequence, batch] activations, which are not read back against the "
                            "reference's; the fix acts at forward mix_adapter",
}


# make test checks every twelfth report (a second or more apiece; `equivcheck field` in make test-full's command test
# and make demo-full run them all), make test-full every one.
SAMPLED_MODULES = [pytest.param(m, id=m.__name__.rsplit(".", 1)[1], marks=() if i % 12 == 0 else pytest.mark.full_only)
                   for i, m in enumerate(MODULES)]


@pytest.mark.usefixtures("locating")
@pytest.mark.parametrize("module", SAMPLED_MODULES)
def test_every_report_is_caught_as_reported_and_equivalent_as_fixed(module):
    row = field.check_module(module)
    assert row.holds, f"{row.bug.reference}: as reported {row.buggy.describe()}; as fixed {row.fixed.describe()}"
    name = module.__name__.rsplit(".", 1)[1]
    if row.located is not None:
        assert row.located is (name not in NOT_WHERE_THE_FIX_ACTS), (row.bug.fix_acts, row.buggy.location)
    if row.bug.expected == ("caught", "equivalent"):
        # Caught by a clear margin or by an exact count, never by a hair; the fix passes with room to spare.
        assert row.buggy.by_count or row.buggy.margin > 10, row.buggy.describe()
        assert row.fixed.margin is None or row.fixed.margin < 0.1, row.fixed.describe()


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__.rsplit(".", 1)[1] for m in MODULES])
def test_every_module_cites_its_report_and_says_what_went_wrong(module):
    bug = module.BUG
    first, _, paragraph = (module.__doc__ or "").partition("\n\n")
    assert first.startswith(f"{bug.reference}: "), f"{module.__name__}: the docstring's first line names {bug.reference}"
    assert len(paragraph.split()) >= 40, f"{module.__name__}: a paragraph of what went wrong, in the module's words"
    assert 0 < len(bug.summary) <= 100
    if bug.not_expressible:
        assert not hasattr(module, "buggy") and not hasattr(module, "fixed")
    else:
        assert callable(module.buggy) and callable(module.fixed)
    assert module.__name__.rsplit(".", 1)[1].endswith(f"_{bug.number}")


def test_where_each_fix_acts_is_declared_and_the_misses_are_rows_that_declare_it():
    declared = [m for m in MODULES if m.BUG.fix_acts]
    assert len(declared) == len([m for m in MODULES if not m.BUG.not_expressible])  # every checked row declares it
    names = {m.__name__.rsplit(".", 1)[1]: m.BUG for m in declared}
    assert set(NOT_WHERE_THE_FIX_ACTS) <= set(names)
    assert all(names[name].fix_acts in why for name, why in NOT_WHERE_THE_FIX_ACTS.items())


def test_the_field_covers_every_family_with_thirty_reports_or_more():
    bugs = [m.BUG for m in MODULES]
    assert len(bugs) >= 30
    assert {b.family for b in bugs} == set(field.FAMILIES)
    assert len({b.reference for b in bugs}) == len(bugs), "one module per report"


def test_the_readme_shows_the_totals_the_command_prints():
    """The command ends with field.totals of the rows it ran; every row holds (the test above), so the README's
    line is the command's."""
    assert field.totals(m.BUG for m in MODULES) in README.read_text()


# The runner's guards: a row that cannot fail is worth nothing.

NANOGPT = "equivcheck_cases.field.nanogpt_168"


def _module(name, bug, buggy=None, fixed=None):
    module = types.ModuleType(name)
    module.BUG = bug
    if buggy is not None:
        module.buggy, module.fixed = buggy, fixed
    return module


def test_a_reproduction_that_is_not_caught_does_not_hold():
    """The report's fixed code standing in for its buggy code: nothing to catch, so the row fails."""
    real = __import__(NANOGPT, fromlist=["BUG"])
    row = field.check_module(_module("fake", real.BUG, buggy=real.fixed, fixed=real.fixed))
    assert row.buggy.state == "equivalent" and not row.holds


def test_a_fix_that_is_not_equivalent_does_not_hold():
    real = __import__(NANOGPT, fromlist=["BUG"])
    row = field.check_module(_module("fake", real.BUG, buggy=real.buggy, fixed=real.buggy))
    assert row.fixed.state == "caught" and not row.holds


def test_a_check_that_raises_is_an_error_row_and_the_other_check_still_runs():
    real = __import__(NANOGPT, fromlist=["BUG"])

    def broken():
        raise RuntimeError("the team's step fell over")

    row = field.check_module(_module("fake", real.BUG, buggy=broken, fixed=real.fixed))
    assert row.buggy.state == "error" and "RuntimeError: the team's step fell over" in row.buggy.detail
    assert row.fixed.state == "equivalent" and not row.holds


def test_a_known_miss_holds_while_missed_and_stops_holding_once_caught():
    real = __import__(NANOGPT, fromlist=["BUG"])
    bug = Bug("karpathy/nanoGPT", "issue", 168, "accumulation", "a stand-in", known_miss="the case cannot show it")
    missed = field.check_module(_module("fake", bug, buggy=real.fixed, fixed=real.fixed))
    assert missed.buggy.state == "missed" and missed.holds
    caught = field.check_module(_module("fake", bug, buggy=real.buggy, fixed=real.fixed))
    assert caught.buggy.state == "caught" and not caught.holds


def test_a_bug_in_torch_itself_is_expected_only_on_the_versions_it_lives_in():
    """Outside its versions the code as reported trains right: the row holds where both checks are equivalent, and a
    check that catches something there is a false alarm, which does not hold."""
    real = __import__(NANOGPT, fromlist=["BUG"])
    installed = torch.__version__.split("+")[0]
    inside = Bug("pytorch/pytorch", "issue", 1, "compile", "a stand-in", torch_from=installed)
    later = Bug("pytorch/pytorch", "issue", 1, "compile", "a stand-in", torch_from="99.0")
    earlier = Bug("pytorch/pytorch", "issue", 1, "compile", "a stand-in", torch_before=installed)
    assert inside.absent == "" and inside.expected == ("caught", "equivalent")
    assert later.absent == f"torch {installed} has no such bug (measured from torch 99.0 on)"
    assert earlier.absent == f"torch {installed} has no such bug (measured before torch {installed})"
    absent = field.check_module(_module("fake", later, buggy=real.fixed, fixed=real.fixed))
    assert absent.holds and absent.buggy.state == "equivalent" and absent.buggy.detail == later.absent
    assert "[1] pytorch/pytorch#1: torch" in field.render([absent])
    false_alarm = field.check_module(_module("fake", later, buggy=real.buggy, fixed=real.fixed))
    assert false_alarm.buggy.state == "caught" and not false_alarm.holds


def test_findings_read_every_verdict():
    def report(verdict, margin=None, reason=""):
        comparison = None if margin is None else types.SimpleNamespace(margin=margin, location=None)
        return ec.Report((ec.Outcome("c", "r", verdict, comparison=comparison, reason=reason),))

    assert field.finding_of(report(ec.Verdict.MISMATCH, 40.0)) == Finding("caught", 40.0)
    assert field.finding_of(report(ec.Verdict.COMMUNICATION, 0.0)).by_count
    assert field.finding_of(report(ec.Verdict.EQUIVALENT, 0.01)) == Finding("equivalent", 0.01)
    assert field.finding_of(report(ec.Verdict.NONDETERMINISTIC, 3.0, "the reference disagrees")).state == "error"
    assert field.finding_of(report(ec.Verdict.SKIPPED, reason="nccl needs a GPU")).state == "skipped"
    with pytest.raises(ec.InvalidArgument, match="expected an equivcheck Report or EvalReport"):
        field.finding_of(None)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"repository": "nanoGPT"}, "repository='nanoGPT'.*'owner/name'"),
    ({"kind": "commit"}, "kind='commit'.*'issue' or 'pull'"),
    ({"family": "rlhf"}, "family='rlhf'.*'accumulation'"),
    ({"not_expressible": "a", "known_miss": "b"}, "either not expressible or a known miss"),
    ({"torch_from": "2.13+cpu"}, r"torch_from='2.13\+cpu' is not allowed: expected a torch release such as '2.13'"),
    ({"torch_before": "next"}, "torch_before='next' is not allowed"),
])
def test_bad_reports_are_named(arguments, message):
    good = {"repository": "karpathy/nanoGPT", "kind": "issue", "number": 168, "family": "accumulation", "summary": "s"}
    with pytest.raises(ec.InvalidArgument, match=message):
        Bug(**{**good, **arguments})


def test_a_row_that_cannot_be_expressed_holds_by_saying_why():
    bug = Bug("karpathy/nanoGPT", "issue", 168, "accumulation", "s", not_expressible="inside torch")
    row = field.check_module(_module("fake", bug))
    assert row.holds and row.buggy is None
    assert "not expressible [1]" in field.render([row]) and "[1] karpathy/nanoGPT#168: inside torch" in field.render([row])


def test_the_command_prints_the_table_and_the_totals_and_writes_json(tmp_path):
    out = tmp_path / "field.json"
    done = subprocess.run([sys.executable, "-m", "equivcheck", "field", "--family", "evaluation", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    evaluation = [m.BUG for m in MODULES if m.BUG.family == "evaluation"]
    assert f"{field.totals(evaluation)}; every row holds in" in done.stdout
    rows = json.loads(out.read_text())
    assert {row["report"] for row in rows} == {b.reference for b in evaluation}
    assert all(row["holds"] and row["url"].startswith("https://github.com/") for row in rows)
    refused = subprocess.run([sys.executable, "-m", "equivcheck", "field", "--family", "rlhf"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "invalid choice: 'rlhf'" in refused.stderr
