"""What torch says while a check trains (its warnings, its log records) caught where the run trains and kept out of
the report: FSDP2's hook warnings, dynamo's "Profiler record function ... will be ignored", twice per pair of ranks,
would otherwise stand between a command's tables.

Each process that trains catches them: a worker rank around each job it answers, the isolating child around each
run, the command around everything it checks (``--no-isolate`` and the launcher train there). A rank and the child
send theirs back with their reply, as plain data; the checking process gathers them (:func:`gathering`, what the
command does, which writes them to a file beside its report and says how many and where) or, where nothing gathers
(the library, the pytest plugin), prints each to its standard error as the process that raised it would have.

Torch's are the warnings raised by code under torch's package folder (the frame that warned, or the file the warning
is attributed to) and the records of torch's loggers. Every other warning, equivcheck's own (``ec.PrecisionWarning``,
``ec.IsolationWarning``) and the case's, goes on as Python's filters say: nothing of the user's is hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from ..errors import EquivcheckWarning

TORCH_FOLDER = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_WARNINGS_FILE = os.path.abspath(warnings.__file__)


@dataclasses.dataclass(frozen=True)
class Said:
    """One warning or log record of torch's, as plain data (it crosses from ranks pickled)."""

    kind: str  # "warning" or "log"
    category: str  # the warning's class (``UserWarning``) or the record's logger and level
    message: str
    filename: str  # where Python attributes it (its stacklevel): ``torch/...``, else relative to the working folder
    lineno: int
    where: str = "in process"  # "rank 1", "isolating child"
    during: str = ""  # the run or job it was raised in, where known

    def located(self, where: str, during: str = "") -> Said:
        return dataclasses.replace(self, where=where, during=self.during or during)

    def text(self) -> str:
        """As Python would have printed it: ``file:line: Category: message`` (a log record: ``logger LEVEL: ...``)."""
        if self.kind == "warning":
            return f"{self.filename}:{self.lineno}: {self.category}: {self.message}"
        return f"{self.category}: {self.message} ({self.filename}:{self.lineno})"


def _relative(filename: str) -> str:
    """``torch/...`` under torch's folder, else relative to the working folder where it lies under it."""
    path = os.path.abspath(filename)
    for folder in (os.path.dirname(TORCH_FOLDER.rstrip(os.sep)), os.getcwd()):
        if path.startswith(folder.rstrip(os.sep) + os.sep):
            return path[len(folder.rstrip(os.sep)) + 1:]
    return filename


def _under_torch(filename: str) -> bool:
    return os.path.abspath(filename).startswith(TORCH_FOLDER)


def _issuer() -> str:
    """The file of the frame that called ``warnings.warn`` (or the torch operation whose C++ code warned): the first
    frame above this module's hook that is not the warnings module's."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or os.path.abspath(frame.f_code.co_filename) == _WARNINGS_FILE):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


def is_torchs(category: type[Warning], filename: str, issuer: str) -> bool:
    return not issubclass(category, EquivcheckWarning) and (_under_torch(filename) or _under_torch(issuer))


class _Collector(logging.Handler):
    """Stands in for torch's loggers' handlers while a run trains: each record they would have printed is kept."""

    def __init__(self, into: list[Said], level: int) -> None:
        super().__init__(level)
        self._into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: kept as written
            message = str(record.msg)
        self._into.append(Said("log", f"{record.name} {record.levelname}", message, _relative(record.pathname),
                               record.lineno))


def _to_terminal(handler: logging.Handler) -> bool:
    """A handler that prints to standard error or output (torch's own, set up by torch._logging), not one that
    writes a file (TORCH_TRACE's, a user's FileHandler)."""
    return (type(handler) is logging.StreamHandler
            and getattr(handler, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__))


def _torch_loggers() -> list[logging.Logger]:
    loggers = [logging.getLogger("torch")]
    loggers += [logger for name, logger in list(logging.Logger.manager.loggerDict.items())
                if name.startswith("torch.") and isinstance(logger, logging.Logger)]
    return [logger for logger in loggers if any(_to_terminal(handler) for handler in logger.handlers)]


@contextlib.contextmanager
def catching() -> Iterator[list[Said]]:
    """Catch torch's warnings and log records raised inside the block into the list it yields; every other warning
    goes on to whatever showed warnings before (the terminal, pytest's recorder, an outer catch)."""
    caught: list[Said] = []
    outer_show, outer_impl = warnings.showwarning, getattr(warnings, "_showwarnmsg_impl", None)
    original = getattr(warnings, "_showwarning_orig", None)

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if is_torchs(category, filename, _issuer()):
            caught.append(Said("warning", category.__name__, str(message), _relative(filename), lineno))
        elif outer_show is not original or outer_impl is None:  # someone replaced showwarning: theirs is called
            outer_show(message, category, filename, lineno, file, line)
        else:  # Python's own, or a recorder (catch_warnings(record=True), pytest)
            outer_impl(warnings.WarningMessage(message, category, filename, lineno, file, line))

    swapped = [(logger, logger.handlers) for logger in _torch_loggers()]
    with warnings.catch_warnings():
        warnings.showwarning = show
        for logger, handlers in swapped:  # what would print is kept, at the level it would print at
            logger.handlers = [_Collector(caught, handler.level) if _to_terminal(handler) else handler
                               for handler in handlers]
        try:
            yield caught
        finally:
            for logger, handlers in swapped:
                logger.handlers = handlers


_gathered: list[Said] | None = None  # while a command gathers (gathering()); ranks and the child send theirs home


@contextlib.contextmanager
def gathering() -> Iterator[list[Said]]:
    """Gather, into the list it yields, torch's warnings and log records raised in this process inside the block and
    those ranks and the isolating child send back meanwhile (:func:`deliver`)."""
    global _gathered
    outer, _gathered = _gathered, []
    gathered = _gathered
    try:
        with catching() as here:
            try:
                yield gathered
            finally:
                gathered[:0] = [said.located("in process") for said in here]
    finally:
        _gathered = outer


def deliver(said: Iterable[Said], where: str, during: str = "") -> None:
    """What a rank or the isolating child caught, received here: gathered where this process gathers, else printed
    to standard error as the process that raised it would have printed it."""
    said = [s.located(where, during) for s in said]
    if _gathered is not None:
        _gathered.extend(said)
        return
    for s in said:
        print(s.text(), file=sys.stderr)


def plain(said: Iterable[Said]) -> list[tuple]:
    return [dataclasses.astuple(s) for s in said]


def from_plain(rows: Iterable[tuple] | None) -> list[Said]:
    return [Said(*row) for row in rows or ()]


def describe(said: list[Said], command: str) -> str:
    """The file the command writes: every distinct warning or record once, with how often and where it was raised."""
    if not said:
        return f"torch raised no warning and logged nothing while `equivcheck {command}` trained.\n"
    counts = Counter((s.kind, s.category, s.message, s.filename, s.lineno) for s in said)
    places: dict[tuple, Counter] = {}
    runs: dict[tuple, list[str]] = {}
    for s in said:
        key = (s.kind, s.category, s.message, s.filename, s.lineno)
        places.setdefault(key, Counter())[s.where] += 1
        if s.during and s.during not in runs.setdefault(key, []):
            runs[key].append(s.during)
    lines = [f"{count_words(said)} raised while `equivcheck {command}` trained, {len(counts)} distinct, most "
             "frequent first (each as Python would have printed it, then how often, where and in which runs):", ""]
    for key, count in counts.most_common():
        kind, category, message, filename, lineno = key
        text = Said(kind, category, message, filename, lineno).text()
        lines.append(f"{count} x {text}")
        lines.append("    raised " + ", ".join(f"{n} x {where}" for where, n in places[key].most_common()))
        shown = runs.get(key, [])
        if shown:
            more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
            lines.append("    in " + "; ".join(shown[:5]) + more)
        lines.append("")
    return "\n".join(lines)


def count_words(said: list[Said]) -> str:
    warned = sum(s.kind == "warning" for s in said)
    logged = len(said) - warned
    parts = [f"{warned} torch warning{'s' * (warned != 1)}"] if warned or not logged else []
    parts += [f"{logged} torch log line{'s' * (logged != 1)}"] if logged else []
    return " and ".join(parts)
