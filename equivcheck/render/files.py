"""Results files written whole or not at all: what a CI job keeps is either the last good file or the new one.

A file is written to a temporary file beside it and renamed into place, so a closed pipe, Ctrl-C, a kill or
a second run writing the same path never leaves it empty or half written, and never destroys the one already
there before the new one exists. A path that is not a regular file (``/dev/stdout``, a FIFO, a device) is
written in place: renaming over it would replace it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

from ..errors import InvalidArgument, ResultsNotWritten


def check_writable(option: str, path: str) -> None:
    """Refuse, before anything runs, a path no file can be written at: its folder missing, or a folder itself.
    Nothing is created or truncated: the file there stays as it is until the new one replaces it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InvalidArgument.value(option, path, "a file that can be written (it is a folder)")
    if not os.path.isdir(folder):
        raise InvalidArgument.value(option, path, "a file that can be written (No such file or directory: "
                                                  f"{folder!r} is not a folder)")


def write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: a temporary file beside it, flushed to disk, then renamed into place.
    Raises :class:`ResultsNotWritten` naming the path and the operating system's reason."""
    try:
        target = os.path.realpath(path)  # a link keeps pointing where it did; its target is replaced
        if _exists_but_not_regular(target):
            with open(target, "w", encoding="utf-8") as special:
                special.write(text)
            return
        _replace(target, text)
    except OSError as error:
        raise ResultsNotWritten(path, error.strerror or str(error)) from None


def _exists_but_not_regular(path: str) -> bool:
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def _replace(target: str, text: str) -> None:
    folder, name = os.path.split(target)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=folder)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, _mode_for(target))
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _mode_for(target: str) -> int:
    """The mode the file has now, or the one a plain ``open(path, "w")`` would give it (mkstemp's is 0o600)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
