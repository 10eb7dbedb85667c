"""Ending a process that imported torch without paying for the interpreter's teardown.

Every optimizer step imports torch._dynamo, and freeing the ~2,000 modules and ~280,000 objects that
torch and dynamo leave behind takes 0.7-0.9 s on 2 cores: longer than a whole check. The CLI and the
distributed workers are processes equivcheck owns and ends, so they leave through here: every exit
handler still runs (atexit: the worker pools' teardown, logging, weakref finalizers), the standard
streams are flushed, and only the freeing of memory the operating system reclaims anyway is skipped.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Run the exit handlers, flush stdout and stderr, and end the process with ``code``.

    While a non-daemon thread is still running the normal exit, which waits for it, is kept."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`equivcheck run | head`) or a closed stream
            pass
    os._exit(code)


def exit_words(code: int) -> str:
    """How a process exited, from its return code as ``subprocess.Popen`` gives it (negative: the signal)."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def leave_with_parent(parent: int, cleanup: Callable[[], None] = lambda: None) -> None:
    """End this process (after ``cleanup``) once ``parent`` is gone, even while its main thread is stuck in a
    collective or a long run: a child equivcheck started never outlives the process that needs its answer."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        cleanup()
        os._exit(1)

    threading.Thread(target=watch, name="equivcheck-parent-watch", daemon=True).start()


PARENT_POLL_SECONDS = 0.5


FRAMES_LIMIT = 20_000  # characters of faulthandler's dump kept in an error's details


def innermost_frame(frames: str) -> str:
    """``forward (model.py:12)``: the frame a faulthandler dump names first (most recent call first) in the thread it
    was dumped from (the one a signal stopped; a dump of every thread lists the others first), or ''."""
    current = frames.find("Current thread")
    found = re.search(r'File "([^"]+)", line (\d+) in (\S+)', frames[max(current, 0):])
    return f"{found[3]} ({os.path.basename(found[1])}:{found[2]})" if found else ""
