"""Runs on a supervised child: a run that kills its process is an ``error`` verdict, not the end of the check.

A kernel can kill the process that calls it (oneDNN's AMX bf16 path dies of SIGILL on some virtual CPUs, an
extension segfaults, code calls ``os._exit``), and no Python handler outlives that. So a check trains its
in-process runs in a child forked from this process on its first run: the child holds the case as this
process has it (model and data functions, closures, a step defined in a test: nothing is pickled), trains
one run per request and sends the result back as plain bytes. A child that dies is reported with how it
exited and the Python frames faulthandler wrote as it died; the next run forks a fresh child. A child that gives no
answer within the run's timeout is asked for every thread's stack, killed, and reported as a hang with that stack.

The child trains and copies every tensor on one torch thread (threads.pin): a process forked after its parent ran an
OpenMP parallel region on several threads inherits a pool whose threads did not survive the fork, and its first
parallel region on more than one thread waits for them for ever.

Forking copies this process's page tables (about 11 ms for a 300 MB process here), so one child serves a
whole check rather than one run.

On a machine with a GPU this process may not fork a child that trains: once anything here has run backward (the
user's other tests in the same pytest process), a forked child cannot, and it cannot start CUDA either
(equivcheck.device). There a run trains on a clean child instead: a one-rank worker forked by the warm pool's
forker, an interpreter that never trained, which imports the case and the regime by name as every rank does. A run
that cannot cross by name (a case built inside a test, a team's step given as a closure) trains in this process,
with an :class:`IsolationWarning` saying why.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection, Pipe

import torch

from ..case import Case
from ..process import progress
from ..process import threads as intra_op
from ..process.forking import fork_is_safe
from ..process import torch_output
from ..process.import_paths import is_bound_path
from ..errors import RAISE_TIMEOUT, InvalidArgument, IsolationWarning, RunDied, WorkerError, warn
from .ranks import pool
from .ranks.jobs import TrainJob
from .train import run_request
from ..process.exit import FRAMES_LIMIT, exit_words, innermost_frame, leave_with_parent
from ..regimes import Regime, parse_regime
from ..registry import importable_source, registered_on_import
from ..result import RunResult
from .request import RunRequest
from ..process.torch_imports import import_what_training_imports

def can_fork(request: RunRequest) -> bool:
    """Whether the run ``request`` asks for can train in a child forked from this process: a CPU run on one thread
    (the default), on a machine without a GPU (equivcheck.device.fork_is_safe). OpenMP's thread pool does not survive
    a fork: a child of a process that has run a parallel region hangs at its own first one, so a run on several
    threads trains in this process."""
    return (request.device == "cpu" and request.regime.device(request.device).type == "cpu" and request.threads == 1
            and fork_is_safe() and not torch.cuda.is_initialized())


def by_name(request: RunRequest) -> str | None:
    """Where a clean child imports the case of ``request`` from, where the case and the regime both cross by name
    (a registered case, a spec that parses back to the regime); else None."""
    try:
        source = importable_source(request.case)
        same = parse_regime(str(request.regime)) == request.regime
    except (InvalidArgument, ValueError, TypeError):
        return None
    return source if same and (is_bound_path(source) or registered_on_import(request.case)) else None


class IsolatedRunner:
    """Trains runs in a forked child, started on the first run and again after a child died.

    It is made with the runs it may be asked for, as (case, regimes) pairs, and a request names one by
    position: a case defined in a test, or a regime holding a team's step (a closure, a lambda), never needs
    pickling. A command that checks many cases gives one runner all of its plans: one child serves them all,
    warm, as this process would have been."""

    def __init__(self, runs: Iterable[tuple[Case, Iterable[Regime]]]) -> None:
        self._runs = [(case, regime) for case, regimes in runs for regime in regimes]
        self._child: _Child | None = None
        self._warned: set[str] = set()

    def train(self, request: RunRequest, timeout: float = pool.DEFAULT_TIMEOUT) -> RunResult:
        """The run ``request`` asks for, in a forked child where this process may fork one, else in a clean child
        (a one-rank worker), either within ``timeout`` seconds, else here. Raises what the run raised,
        :class:`RunDied` (:class:`WorkerError` from a clean child) naming how the child ended when it died, or
        :class:`WorkerError` with the child's stack where it made no progress for ``timeout`` seconds."""
        if can_fork(request):
            return self._forked(request, timeout)
        source = by_name(request) if request.threads == 1 else None
        if source is not None:
            replies = pool.run_job("gloo", 1, TrainJob.of(request, source), timeout)
            return RunResult.from_plain(replies[0])
        self._warn_here(request)
        return run_request(request)

    def _warn_here(self, request: RunRequest) -> None:
        why = (f"it trains on {request.threads} threads, and a forked child's OpenMP pool would hang"
               if request.threads != 1 else
               f"this machine has a GPU, so its isolating child imports the case and the regime by name, and case "
               f"{request.case.name!r} under {str(request.regime)!r} cannot cross by name (define or register the case "
               "at a module's top level, not inside a test; a team's step given as a function crosses only to ranks)")
        if why not in self._warned:
            self._warned.add(why)
            warn(IsolationWarning(f"a run of {request.case.name!r} trains in the checking process: {why}; a crash "
                                  "there ends the check"))

    def _forked(self, request: RunRequest, timeout: float) -> RunResult:
        case, regime = request.case, request.regime
        index = self._index(case, regime)
        if index is None:  # a run the child was not forked with: the next child knows it
            self._runs.append((case, regime))
            index = len(self._runs) - 1
            self.close()
        if self._child is None:
            self._child = _Child(self._runs)
        child = self._child
        try:
            return child.train(index, request.settings(), timeout)
        except BaseException:
            if not child.alive:  # it died, or was stopped mid-run (Ctrl-C): the next run forks a fresh child
                self._child = None
            raise

    def _index(self, case: Case, regime: Regime) -> int | None:
        return next((i for i, (c, r) in enumerate(self._runs) if c is case and r == regime), None)

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None


class _Child:
    def __init__(self, runs: Sequence[tuple[Case, Regime]]) -> None:
        import_what_training_imports()  # once in this process, not once per child
        self._crash_log = tempfile.TemporaryFile()  # faulthandler's last words, read after a death
        self._progress = tempfile.TemporaryFile()  # when the child last made progress (progress.py)
        receiving, sending = Pipe(duplex=False)
        requests_in, self._requests = Pipe(duplex=False)
        for stream in (sys.stdout, sys.stderr):  # buffered output would be written twice, once by each process
            stream.flush()
        parent = os.getpid()
        reap_exited()
        with warnings.catch_warnings():  # Python 3.12 warns on forking a threaded process; the child runs no thread's work
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            receiving.close()
            self._requests.close()
            _serve(runs, requests_in, sending, self._crash_log.fileno(), self._progress.fileno(), parent)
        sending.close()
        requests_in.close()
        self.pid, self._replies, self.alive, self._runs = pid, receiving, True, runs

    def train(self, index: int, settings: dict, timeout: float) -> RunResult:
        case, regime = self._runs[index]
        what = f"{case.name} under {regime}"
        try:
            self._requests.send_bytes(pickle.dumps((index, settings)))
            started = time.monotonic()
            with progress.waiting():
                stamp = self._progress.fileno()
                status, payload, said = receive(
                    self._replies, lambda: progress.deadline(started, timeout, [progress.last(stamp)]))
        except TimeoutError:  # before OSError, which it is
            raise self._hung(what, timeout) from None
        except (EOFError, OSError):
            raise self._death() from None
        except BaseException:  # interrupted: the child may still be training, and its reply would answer nothing
            self.kill()
            raise
        torch_output.deliver(torch_output.from_plain(said), "isolating child", what)
        if status == "ok":
            return RunResult.from_plain(payload)
        raise payload

    def _death(self) -> RunDied:
        """The child is gone: how it ended, and where Python stood when it did."""
        self.alive = False
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        frames = os.pread(self._crash_log.fileno(), FRAMES_LIMIT, 0).decode(errors="replace").strip()
        self._close_files()
        where = innermost_frame(frames)
        return RunDied(f"the run's process died ({exit_words(code)})" + (f" in {where}" if where else ""),
                       remote_traceback=frames, exit_code=code)

    def _hung(self, what: str, timeout: float) -> WorkerError:
        """The child made no progress in time: where its threads stand (faulthandler's dump on HANG_SIGNAL), then it is
        killed, so that nothing it says later can answer another run."""
        log = self._crash_log.fileno()
        written = os.fstat(log).st_size
        try:
            os.kill(self.pid, HANG_SIGNAL)
        except ProcessLookupError:
            pass
        deadline, size = time.monotonic() + DUMP_SECONDS, written
        while time.monotonic() < deadline:  # until the dump has begun and stopped growing
            time.sleep(0.05)
            size, before = os.fstat(log).st_size, size
            if written < size == before:
                break
        frames = os.pread(log, FRAMES_LIMIT, written).decode(errors="replace").strip()
        self.kill()
        where = innermost_frame(frames)
        return WorkerError(f"{what}: the isolating child made no progress for {timeout:g} s, no step taken and "
                           f"nothing compiled (a hang"
                           + (f", in {where}" if where else "") + f"); it was killed; {RAISE_TIMEOUT}",
                           remote_traceback=f"the isolating child's stack when it timed out:\n{frames}".strip())

    def kill(self) -> None:
        if self.alive:
            self.alive = False
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._close_files()

    def close(self) -> None:
        """Ask the child to leave: it reads EOF and exits. It is reaped later (its exit takes milliseconds that
        nobody needs to wait for), at the next fork or when this process exits."""
        if self.alive:
            self.alive = False
            self._close_files()
            _exiting.append(self.pid)

    def _close_files(self) -> None:
        for closing in (self._requests, self._replies, self._crash_log, self._progress):
            closing.close()


HANG_SIGNAL = signal.SIGUSR1  # on it the child writes every thread's stack to its crash log
DUMP_SECONDS = 1.0  # how long a timed-out run waits for that stack before the child is killed
_exiting: list[int] = []  # children asked to leave, not yet reaped
EXIT_SECONDS = 5.0  # how long this process's exit waits for them before killing them


def reap_exited() -> None:
    """Reap the children that have left since they were asked to."""
    for pid in list(_exiting):
        if os.waitpid(pid, os.WNOHANG)[0]:
            _exiting.remove(pid)


@atexit.register
def wait_for_exited() -> None:
    """No child outlives this process: each one asked to leave gets a few seconds, then SIGKILL."""
    deadline = time.monotonic() + EXIT_SECONDS
    while _exiting and time.monotonic() < deadline:
        reap_exited()
        time.sleep(0.005)
    for pid in _exiting:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    _exiting.clear()


def _serve(runs: Sequence[tuple[Case, Regime]], requests: Connection, replies: Connection, crash_log: int,
           progress_log: int, parent: int) -> None:
    """The child: train each requested run and answer it, until the parent closes its end. Never returns."""
    code = 0
    try:
        faulthandler.enable(file=crash_log, all_threads=False)
        faulthandler.register(HANG_SIGNAL, file=crash_log, all_threads=True)  # where it stands when it hangs
        progress.report_to(progress_log)  # the parent times a run out on silence alone
        intra_op.pin(1)  # forked: the parent's OpenMP pool did not come along, so every region runs on this thread
        # A terminal's Ctrl-C is the parent's to handle (it kills this child); SIGTERM ends the child at once,
        # where the parent's handler would raise inside a run and print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        leave_with_parent(parent)
        while True:
            try:
                index, settings = pickle.loads(requests.recv_bytes())
            except EOFError:
                break
            with torch_output.catching() as caught:  # sent home with the reply (the parent gathers or prints them)
                try:
                    case, regime = runs[index]
                    reply = ("ok", run_request(RunRequest.rebuilt(case, regime, settings)).to_plain())
                except Exception as error:
                    reply = ("raised", _portable(error))
            send(replies, (*reply, torch_output.plain(caught)))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _portable(error: Exception) -> Exception:
    """``error`` with its traceback attached, as the parent can unpickle it: the same type where it pickles
    (an Unavailable stays a skip, an InvalidArgument a usage error), else a RuntimeError naming it."""
    error.remote_traceback = getattr(error, "remote_traceback", "") or traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        portable = RuntimeError(f"{type(error).__name__}: {error}")
        portable.remote_traceback = error.remote_traceback
        return portable


def send(conn: Connection, value: object) -> None:
    """Pickle ``value`` with its large buffers (numpy arrays) sent beside the pickle, not copied into it."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    conn.send_bytes(pickle.dumps((head, [raw.nbytes for raw in raws])))
    for raw in raws:
        conn.send_bytes(raw)


def receive(conn: Connection, deadline: Callable[[], float] | None = None) -> object:
    """What :func:`send` sent; each buffer is read straight into memory the result then owns. Raises
    :class:`TimeoutError` where a part of it has not begun to arrive by ``deadline()`` (``time.monotonic()``), asked
    again while it waits: the sender's progress moves it."""

    def arriving() -> None:
        while deadline is not None and not conn.poll(max(0.0, deadline() - time.monotonic())):
            if deadline() <= time.monotonic():
                raise TimeoutError

    arriving()
    head, sizes = pickle.loads(conn.recv_bytes())
    buffers = []
    for size in sizes:
        arriving()
        buffer = bytearray(size)
        if size:
            conn.recv_bytes_into(buffer)
        else:
            conn.recv_bytes()
        buffers.append(buffer)
    return pickle.loads(head, buffers=buffers)
