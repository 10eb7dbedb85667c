"""Every error equivcheck raises and every warning it issues, in one place.

Bad input raises :class:`InvalidArgument` (a ``ValueError``) whose message names the argument, the
value it got and what is allowed. A failed equivalence raises :class:`NotEquivalent` (an
``AssertionError``, so pytest shows it as a test failure rather than an error). Every error derives
from :class:`EquivcheckError`, every warning from :class:`EquivcheckWarning`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
import warnings
from collections.abc import Iterable, Iterator


class EquivcheckError(Exception):
    """Base class of every equivcheck error."""


class InvalidArgument(EquivcheckError, ValueError):
    """An argument, a case or a regime spec that equivcheck cannot use."""

    @classmethod
    def value(cls, argument: str, value: object, allowed: str) -> InvalidArgument:
        """``chunks=0 is not allowed: expected an integer from 1 to 12``."""
        return cls(f"{argument}={value!r} is not allowed: expected {allowed}")

    @classmethod
    def type(cls, argument: str, value: object, expected: str) -> InvalidArgument:
        """``Expected int but got chunks='4' (type=str)``."""
        return cls(f"Expected {expected} but got {argument}={value!r} (type={type(value).__name__})")

    @classmethod
    def unknown(cls, what: str, name: str, known: Iterable[str]) -> InvalidArgument:
        """``unknown case 'mpl'; known cases: cnn, mlp``."""
        listed = ", ".join(sorted(known)) or "(none)"
        return cls(f"unknown {what} {name!r}; known {what}s: {listed}")


class NotEquivalent(EquivcheckError, AssertionError):
    """A regime did not reproduce the reference (or matched where a mismatch was declared)."""


class MemoryNotSaved(EquivcheckError, AssertionError):
    """A regime's peak activation memory is above the ratio of the reference's that it must stay under."""


def expect_int(argument: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int within bounds, else raise a message naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument.type(argument, value, "int")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
        raise InvalidArgument.value(argument, value, bound)
    return value


def expect_callable(argument: str, value: object) -> None:
    if not callable(value):
        raise InvalidArgument.type(argument, value, "a callable")


def expect_number(argument: str, value: object, *, minimum: float, maximum: float, strict: bool = False) -> float:
    """Return ``value`` if it is a finite real number within bounds (above ``minimum`` when ``strict``)."""
    bounds = (f"> {minimum:g}" if strict else f">= {minimum:g}") + (f" and <= {maximum:g}" if maximum < math.inf else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument.type(argument, value, f"a number {bounds}")
    if not (math.isfinite(value) and (value > minimum if strict else value >= minimum) and value <= maximum):
        raise InvalidArgument.value(argument, value, f"a finite number {bounds}")
    return float(value)


RAISE_TIMEOUT = ("if it is only slow, allow more: --timeout SECONDS (equivcheck run), timeout= (ec.check, "
                 "check_step, check_loop), --equivcheck-timeout or @pytest.mark.equivcheck(timeout=...) (pytest)")
MAX_TIMEOUT = 86_400.0  # seconds: a day bounds any job, and keeps select() and sleep() from overflowing
MAX_SEED = 2**32 - 1  # numpy's seeds stop here


def expect_tolerances(rtol: object, atol: object) -> None:
    """rtol and atol go together, each a finite number >= 0: an infinite tolerance would pass anything."""
    if (rtol is None) != (atol is None):
        raise InvalidArgument.value("rtol" if rtol is not None else "atol", rtol if rtol is not None else atol,
                                    f"rtol and atol given together (rtol={rtol!r}, atol={atol!r})")
    if rtol is not None:
        expect_number("rtol", rtol, minimum=0, maximum=1)
        expect_number("atol", atol, minimum=0, maximum=1)


def expect_timeout(timeout: object) -> float:
    return expect_number("timeout", timeout, minimum=0, maximum=MAX_TIMEOUT, strict=True)


def expect_seed(seed: object) -> int:
    return expect_int("seed", seed, minimum=0, maximum=MAX_SEED)


class WorkerError(EquivcheckError, RuntimeError):
    """A worker rank raised, hung past its timeout or died; the message names the rank(s).

    ``remote_traceback`` holds the traceback of the rank that raised, where one did; ``raised`` says the
    code checked raised (evidence about that code), as opposed to a rank that died, hung or never started.
    """

    def __init__(self, message: str, *, remote_traceback: str = "", raised: bool = False) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.raised = raised


class RunDied(WorkerError):
    """A process training a run (an isolated run's child, a rank) died before it answered: a signal (SIGILL in a
    kernel, SIGSEGV) or an exit.

    ``remote_traceback`` holds the Python frames faulthandler wrote as it died, where it could; ``exit_code`` is
    how it ended, as ``subprocess.Popen.returncode`` says it (negative: the signal)."""

    def __init__(self, message: str, *, remote_traceback: str = "", exit_code: int = 0) -> None:
        super().__init__(message, remote_traceback=remote_traceback)
        self.exit_code = exit_code


class ResultsNotWritten(EquivcheckError, OSError):
    """A results file (``--json``, ``--html``, ``--markdown``) could not be written; the one there before is kept."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"could not write {path}: {reason}")
        self.path, self.reason = path, reason


class CodeExited(EquivcheckError, RuntimeError):
    """The code checked raised SystemExit (``sys.exit()``, ``exit()``, argparse giving up) while it ran: an error
    of that code, told where it happened, never the end of the check or of the process running it."""


@contextlib.contextmanager
def exits_as_errors() -> Iterator[None]:
    """Turn a SystemExit raised inside into :class:`CodeExited` naming the code and the line that raised it."""
    try:
        yield
    except SystemExit as done:
        frames = traceback.extract_tb(done.__traceback__)
        place = f" at {frames[-1].filename}:{frames[-1].lineno} (in {frames[-1].name})" if frames else ""
        raise CodeExited(f"the code checked raised SystemExit({done.code!r}){place}") from done


class DropoutNotPlaced(EquivcheckError, RuntimeError):
    """A rank cannot tell which part of the global batch's dropout masks is its own (the batch not on dim 0, inputs
    that are no slice of a global batch, an attention kernel's own ``dropout_p``): that check is an error saying why,
    never a run with other masks."""


class Unavailable(EquivcheckError):
    """This machine cannot run the regime (for example: no GPUs for nccl or DataParallel)."""


class NonFinite(EquivcheckError, ArithmeticError):
    """A run produced a NaN or an infinity: a loss, a gradient or a weight. Nothing can be compared."""


class EquivcheckWarning(UserWarning):
    """Base class of every warning equivcheck issues: ``warnings.simplefilter("error", ec.EquivcheckWarning)``
    makes each an error, ``"ignore"`` silences them all."""


class BlindSpotWarning(EquivcheckWarning):
    """The case cannot show a class of bug the code checked could plausibly have: a pass proves less
    than it seems. ``ec.audit(case)`` lists every class; silence with the ``warnings`` filters."""


class IsolationWarning(EquivcheckWarning):
    """A run the caller asked to isolate trained in the checking process: a crash there ends the check."""


class PrecisionWarning(EquivcheckWarning):
    """The case asks for a precision its computation does not run in (a float64 case whose loss comes out
    in float32): the tolerance then assumes rounding the runs do not have."""


# equivcheck and its pytest plugin, side by side wherever they are installed: a warning's frames to skip
_OWN_CODE = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package) + os.sep
                  for package in ("equivcheck", "pytest_equivcheck"))


def warn(warning: Warning) -> None:
    """Issue ``warning`` at the user's own call, the first frame outside equivcheck and its plugin, however
    deep inside them it was found (what Python 3.12's ``skip_file_prefixes`` does)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_CODE):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level)


class Interrupted(BaseException):
    """SIGTERM asked the command to stop; like KeyboardInterrupt, not an error of the code checked."""
