"""Every error equivcheck raises, in one place.

Bad input raises :class:`InvalidArgument` (a ``ValueError``) whose message names the argument, the
value it got and what is allowed. A failed equivalence raises :class:`NotEquivalent` (an
``AssertionError``, so pytest shows it as a test failure rather than an error).
"""

from __future__ import annotations

from collections.abc import Iterable


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


class WorkerError(EquivcheckError, RuntimeError):
    """A worker rank raised, hung past its timeout or died; the message names the rank(s).

    ``remote_traceback`` holds the traceback of the rank that raised, where one did.
    """

    def __init__(self, message: str, *, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


class Unavailable(EquivcheckError):
    """This machine cannot run the regime (for example: no GPUs for nccl or DataParallel)."""
