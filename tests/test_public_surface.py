"""What users meet is importable from ``equivcheck`` itself, and every warning shares one base."""

import warnings

import pytest

import equivcheck as ec
from equivcheck import errors


# Each reaches users: raised by a run or a check (NonFinite, RunDied, CodeExited, ResultsNotWritten), the status of
# a whole report (Report.status), a built-in regime class with its own fields (ddp_hook:hook=...).
MET_BY_USERS = ("NonFinite", "RunDied", "Status", "DdpHook", "CodeExited", "ResultsNotWritten", "EquivcheckWarning")


@pytest.mark.parametrize("name", MET_BY_USERS)
def test_what_users_meet_is_exported(name):
    assert name in ec.__all__
    assert getattr(ec, name).__name__ == name


def test_every_exported_name_exists_and_all_is_sorted_by_kind():
    assert [name for name in ec.__all__ if not hasattr(ec, name)] == []
    kinds = lambda name: (0 if name.isupper() else 1 if name[0].isupper() else 2, name)  # noqa: E731
    assert ec.__all__ == sorted(ec.__all__, key=kinds)
    assert len(set(ec.__all__)) == len(ec.__all__)


def test_the_exported_status_is_the_one_reports_carry():
    report = ec.check("seed004_linear", "full_batch")
    assert report.status is ec.Status.OK


def test_errors_users_catch_are_equivchecks():
    assert issubclass(ec.RunDied, ec.WorkerError) and issubclass(ec.NonFinite, ec.EquivcheckError)
    assert issubclass(ec.CodeExited, ec.EquivcheckError) and issubclass(ec.ResultsNotWritten, OSError)


def test_every_warning_derives_from_one_base():
    """One filter reaches them all: each warning class errors.py defines derives from EquivcheckWarning."""
    defined = [value for value in vars(errors).values()
               if isinstance(value, type) and issubclass(value, Warning) and value.__module__ == errors.__name__]
    assert {ec.BlindSpotWarning, ec.PrecisionWarning, ec.EquivcheckWarning} <= set(defined)
    assert all(issubclass(warning, ec.EquivcheckWarning) for warning in defined)
    assert issubclass(ec.EquivcheckWarning, UserWarning)


@pytest.mark.parametrize("warning", ["BlindSpotWarning", "PrecisionWarning"])
def test_an_error_filter_on_the_base_catches_each_warning(warning):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ec.EquivcheckWarning)
        with pytest.raises(getattr(ec, warning)):
            errors.warn(getattr(ec, warning)("seen"))


def test_an_error_filter_on_the_base_catches_a_blind_spot_found_by_check_step():
    """seed004_linear holds one item per sample: a normalisation bug cannot show, and check_step says so."""
    def step(model, optimizer, batch):
        inputs, targets = batch
        loss = ec.get_case("seed004_linear").loss(model(inputs), targets).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error", ec.EquivcheckWarning)
        with pytest.raises(ec.BlindSpotWarning):
            ec.check_step("seed004_linear", step)
