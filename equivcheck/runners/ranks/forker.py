"""Ranks forked from a warm interpreter: a new rank costs a fork, not an interpreter with torch.

A fresh interpreter spends about two seconds importing torch, and a rank's first job more on what torch
imports lazily (creating an optimizer loads ``torch._dynamo``): every pool start, every new world size and
every restart after a fault paid it, per rank. So each process that starts pools has one forker: an
interpreter started once, in a session of its own, that imports what a rank runs and nothing else (no
case, no CUDA context, one thread), then forks each rank on request. A rank takes the environment, import
path, working directory and standard streams its pool has when it starts, as a fresh interpreter would.

The forker is the ranks' parent: it reaps them and reports each exit status, and the pool sees a rank
through :class:`ForkedRank`, which answers what ``subprocess.Popen`` answers. Ranks are grouped by pool,
so a pool whose start was interrupted has the forker kill every rank it forked for it, including one whose
pid the interrupted start never learned. The forker leaves when the process that started it is gone; its
ranks then see their parent change and leave too (``process.exit.leave_with_parent``).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from ...errors import WorkerError
from ...process.exit import exit_words
from ...process.import_paths import WITHOUT_WORKING_DIRECTORY, search_path
from ...process.torch_imports import TRAINING_IMPORTS

PRELOADED = ("torch", "torch.distributed", *TRAINING_IMPORTS, "equivcheck.runners.ranks.worker", "equivcheck.runners.ranks.jobs")
# One thread in the forker: numpy's BLAS (which follows OpenMP's setting) would start one per core, and a thread
# at work when the forker forks is lost mid-work in the rank. A rank sets its own count (worker_main).
FORKER_ENVIRONMENT = {"OMP_NUM_THREADS": "1"}
STANDARD_STREAMS = (0, 1, 2)
ORPHANED_EXIT = 1  # how a rank whose forker died leaves (process.exit.leave_with_parent); nobody is left to reap it
# The forker's command. Not ``python -m``, and no working directory on its path: a file lying there would run in the
# forker and so in every rank, though the process that checks never imports it. Its path is its parent's (PYTHONPATH).
FORKER_COMMAND = WITHOUT_WORKING_DIRECTORY + "from equivcheck.runners.ranks.forker import main; main()"
POLL_SECONDS = 0.05  # how often the forker reaps its ranks and looks whether its parent lives


class Forker:
    """The parent's end: fork ranks, learn how they exited, signal them."""

    def __init__(self, start_timeout: float) -> None:
        parent_end, forker_end = socket.socketpair()
        self._socket, self._conn = parent_end, Connection(os.dup(parent_end.fileno()))
        self._lock = threading.Lock()  # one request and its answer at a time
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: the signal), as Popen.returncode
        self._requests = 0  # every spawn names its request: an answer to an interrupted one is never taken
        self._ready = False
        self._gone = False  # the forker died: no exit of its ranks can be read any more
        self.death = ""  # how the forker ended, once it is gone: ranks it forked left with it
        self._start_timeout = start_timeout
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", FORKER_COMMAND, str(forker_end.fileno()), str(os.getpid())],
                env=os.environ | FORKER_ENVIRONMENT | {"PYTHONPATH": os.pathsep.join(search_path())},
                pass_fds=[forker_end.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)  # a terminal's Ctrl-C reaches the parent only
        finally:
            forker_end.close()
        self._owner = os.getpid()

    @property
    def alive(self) -> bool:
        return self._owner == os.getpid() and not self._gone and self._process.poll() is None

    @property
    def ready(self) -> bool:
        """Whether the forker has finished its imports (a rank forks at once), without waiting."""
        with self._lock:
            try:
                while not self._ready:
                    self._read(0.0)
            except (TimeoutError, WorkerError):
                pass
        return self._ready

    def spawn(self, group: str, argv: list[str], fd: int, env: dict[str, str], path: list[str],
              cwd: str) -> ForkedRank:
        """Fork a rank of pool ``group`` that runs ``worker.worker_main`` with ``argv`` and ``fd`` as its end of the
        pool's pipe, in environment ``env`` with module search path ``path`` and working directory ``cwd``."""
        streams = [stream for stream in STANDARD_STREAMS if _is_open(stream)]
        with self._lock:
            self._wait_until_ready()
            self._requests += 1
            try:
                self._conn.send(("spawn", self._requests, group, argv, env, path, cwd, streams))
                socket.send_fds(self._socket, [b"f"], [fd, *streams])  # a rank writes where its pool writes
            except OSError:
                self.retire()
                raise WorkerError("the forker that starts the ranks is gone") from None
            except BaseException:  # interrupted inside the request: the forker may be waiting for the rest of it
                self.retire()
                raise
            while True:
                message = self._read_in_time("fork a rank")
                if message[0] == "spawned" and message[1] == self._requests:
                    return ForkedRank(self, message[2])

    def kill_group(self, group: str) -> None:
        """SIGKILL every rank of pool ``group`` still running, known to its pool or not."""
        self._send(("kill_group", group))

    def signal(self, pid: int, signum: int) -> None:
        """Signal rank ``pid``. The forker sends it only while the rank is its unreaped child, so a pid the system
        has since given to another process is never signalled."""
        self._send(("signal", pid, signum))

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """How rank ``pid`` exited, waiting up to ``timeout`` seconds (None: for ever) for the forker to say;
        None while it runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                if self._gone:
                    return ORPHANED_EXIT
                try:
                    self._read(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return None
                except WorkerError:
                    return ORPHANED_EXIT
            return self._exits[pid]

    def _wait_until_ready(self) -> None:
        """The forker's imports take as long as a fresh interpreter's; an interrupt here has sent no request."""
        while not self._ready:
            self._read_in_time("import torch")

    def _read_in_time(self, what: str) -> tuple:
        try:
            return self._read(self._start_timeout)
        except TimeoutError:
            self.retire()
            raise WorkerError(f"the forker that starts the ranks did not {what} within {self._start_timeout:g} s; "
                              "it was stopped") from None

    def _read(self, timeout: float | None) -> tuple:
        """The next message from the forker, noting exits and readiness on the way; TimeoutError when none came
        within ``timeout``, WorkerError when the forker is gone."""
        try:
            ready = self._conn.poll(timeout)  # an interrupt while waiting here leaves the channel whole
            message = self._whole_message() if ready else None
        except (EOFError, OSError):
            self._gone = True
            self.death = exit_words(self._process.wait())
            raise WorkerError(f"the forker that starts the ranks is gone ({self.death})") from None
        if message is None:
            raise TimeoutError
        if message[0] == "exit":
            self._exits[message[1]] = message[2]
        elif message[0] == "ready":
            self._ready = True
        return message

    def _whole_message(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise
        except BaseException:  # interrupted inside a message: the rest of it would be read as the next one
            self.retire()
            raise

    def retire(self) -> None:
        """Stop this forker for good (SIGKILL: it may be stopped or stuck); its ranks leave with it, and the next
        pool starts a new one."""
        self._gone = True
        self._process.kill()
        self.death = f"stopped by equivcheck, {exit_words(self._process.wait())}"

    def _send(self, message: tuple) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except OSError:
                pass  # the forker is gone, and every rank with it

    def close(self) -> None:
        self._conn.close()  # the forker reads EOF and leaves
        self._socket.close()
        try:
            self._process.wait(5.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class ForkedRank:
    """A forked rank, seen through what ``subprocess.Popen`` offers: pid, poll, wait, send_signal, kill."""

    def __init__(self, forker: Forker, pid: int) -> None:
        self._forker, self.pid = forker, pid

    def poll(self) -> int | None:
        return self._forker.returncode(self.pid, 0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._forker.returncode(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return code

    def send_signal(self, signum: int) -> None:
        self._forker.signal(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def orphaned(self) -> str:
        """Why this rank's exit cannot be known, where its forker is gone (ranks leave with it); else ''."""
        death = self._forker.death
        return f"the forker that starts and reaps the ranks is gone ({death}), and its ranks with it" if death else ""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_forker: Forker | None = None


def forker(start_timeout: float) -> Forker:
    """This process's forker: started on first use, and again if it died or this process is a fork of another."""
    global _forker
    if _forker is None or not _forker.alive:
        _forker = Forker(start_timeout)
    return _forker


@atexit.register
def shutdown_forker() -> None:
    """Stop this process's forker (its ranks leave with it); the next pool starts a new one."""
    global _forker
    if _forker is not None and _forker.alive:
        _forker.close()
    _forker = None


# The forker's side, run by FORKER_COMMAND.

def main() -> None:
    """The forker's process: ``FORKER_COMMAND FD PARENT_PID``. A parent that stopped listening (its run ended
    while the forker still imported torch) ends the forker quietly: the terminal they share gets no traceback."""
    from ...process.exit import exit_without_teardown

    try:
        serve(int(sys.argv[1]), int(sys.argv[2]))
    except (BrokenPipeError, ConnectionResetError):
        pass
    exit_without_teardown(0)


def serve(fd: int, parent: int) -> None:
    """Import what a rank runs, then fork ranks on request and report each exit, until the parent is gone."""
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    channel, conn = socket.socket(fileno=fd), Connection(os.dup(fd))
    conn.send(("ready",))
    groups: dict[int, str] = {}  # each unreaped rank's pool
    while os.getppid() == parent:
        for pid, code in _reaped():
            groups.pop(pid, None)
            conn.send(("exit", pid, code))
        if not conn.poll(POLL_SECONDS):
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed its end
        if message[0] == "spawn":
            _, request, group, argv, env, path, cwd, streams = message
            _, fds, _, _ = socket.recv_fds(channel, 1, 1 + len(streams))
            pid = os.fork()
            if pid == 0:
                _become_rank(channel, conn, fds[0], dict(zip(streams, fds[1:])), argv, env, path, cwd)
            for received in fds:
                os.close(received)
            groups[pid] = group
            conn.send(("spawned", request, pid))
        elif message[0] == "signal":
            _signal([message[1]], message[2], groups)
        elif message[0] == "kill_group":
            _signal([pid for pid, group in groups.items() if group == message[1]], signal.SIGKILL, groups)


def _signal(pids: list[int], signum: int, groups: dict[int, str]) -> None:
    for pid in pids:
        if pid in groups:  # unreaped: even a zombie keeps its pid
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _reaped() -> list[tuple[int, int]]:
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, os.waitstatus_to_exitcode(status)))


def _become_rank(channel: socket.socket, conn: Connection, fd: int, streams: dict[int, int], argv: list[str],
                 env: dict[str, str], path: list[str], cwd: str) -> None:
    """In the forked child: the rank a fresh interpreter with this environment would be. Never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own, as the forker has
        conn.close()
        channel.close()  # only the forker speaks for the ranks
        for standard, received in streams.items():
            os.dup2(received, standard)
            os.close(received)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        os.chdir(cwd)
        from ...process.exit import exit_without_teardown
        from .worker import worker_main

        rank, world_size, backend, store, threads, start_timeout = argv
        worker_main(int(rank), int(world_size), backend, store, Connection(fd), os.getppid(), int(threads),
                    float(start_timeout))
        exit_without_teardown(0)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
