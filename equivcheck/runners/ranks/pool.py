"""A warm pool of worker ranks per (backend, world size), alive for a whole CLI run or test session.

Starting a process group costs time (each rank is forked from a warm interpreter, see forker.py, then
joins the rendezvous); a job on a warm pool costs milliseconds. The rendezvous is a file in a fresh
temporary folder, so pools never collide (``pytest -n 2`` runs several side by side); gloo's own
connections between the ranks listen on the loopback interface only. Any fault (a rank that raises, hangs past the timeout or
dies) and any exception while a job is in flight (Ctrl-C included) tears the whole pool down,
leaving no process behind: a reply left unread must never answer the next job. Every job carries
its number and every reply names the job it answers; the next job starts a fresh pool.

Ranks run in a session of their own, so a terminal's Ctrl-C reaches only the parent, which stops
them; ranks whose parent died remove the pool's folder and exit.
"""

from __future__ import annotations

import atexit
import glob
import multiprocessing
import os
import shutil
import signal
import subprocess
import tempfile
import time
from multiprocessing.connection import wait
from typing import NamedTuple

from ...errors import RAISE_TIMEOUT, InvalidArgument, RunDied, WorkerError
from .capacity import ensure_room
from ...process.exit import FRAMES_LIMIT, exit_words, innermost_frame
from .forker import ForkedRank, forker
from ...process.import_paths import search_path
from ...process import progress, torch_output
from .jobs import Job
from .shared_reference import REFERENCE_PREFIX
from .worker import INSIDE_RANK_VARIABLE, progress_file, stack_file

DEFAULT_TIMEOUT = 60.0  # seconds a job's ranks may go without progress (a step taken, a graph compiled)
START_TIMEOUT = 120.0  # seconds to start the ranks and join the process group
WORKER_THREADS = 1  # torch threads per rank: ranks share the machine's cores
DEATH_GRACE = 1.0  # seconds a rank's error waits for a peer's death to show: the death is the cause
FORKER_ANSWER_SECONDS = 2.0  # how long closing a pool waits for the forker to report a killed rank before retiring it


class Ticket(NamedTuple):
    """A job sent and not yet collected: its number (replies must carry it), when it was sent, how long its ranks may go
    without progress (progress.py), and what it is."""

    number: int
    started: float
    timeout: float
    what: str


class WorkerPool:
    def __init__(self, backend: str, world_size: int, *, threads: int = WORKER_THREADS,
                 start_timeout: float = START_TIMEOUT) -> None:
        self.backend, self.world_size = backend, world_size
        self._forker = forker(start_timeout)
        remove_orphaned_folders()
        self._folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")  # whose pool it is, by name
        store = os.path.join(self._folder, "rendezvous")
        # The parent's import path, so that ranks import case modules by the same names; gloo's connections
        # between the ranks listen on loopback, never on an outside interface.
        path = search_path()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(path), "GLOO_SOCKET_IFNAME": LOOPBACK}
        self._conns, self._processes = [], []
        self._jobs = 0  # the number of the last job sent; replies must carry it
        self._in_flight: Ticket | None = None
        try:
            for rank in range(world_size):
                # A private socket pair per rank: no port, no authentication to get wrong, and EOF when either dies.
                parent_end, child_end = multiprocessing.Pipe(duplex=True)
                self._conns.append(parent_end)
                argv = [str(rank), str(world_size), backend, store, str(threads), str(start_timeout)]
                try:
                    self._processes.append(
                        self._forker.spawn(self._folder, argv, child_end.fileno(), env, path, os.getcwd()))
                finally:
                    child_end.close()
            self._gather(Ticket(0, time.monotonic(), start_timeout, "start"))
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.poll() is None for p in self._processes)

    def run(self, job: Job, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
        """Send ``job`` to every rank and return each rank's reply.

        A fault, and any exception while the job is in flight (KeyboardInterrupt included), closes
        the pool before it propagates: its ranks may still be working on this job."""
        return self.collect(self.submit(job, timeout))

    def submit(self, job: Job, timeout: float = DEFAULT_TIMEOUT) -> Ticket:
        """Send ``job`` to every rank and return at once: the parent works on while the ranks train. One job
        is in flight at a time; :meth:`collect` must come next, or :meth:`close` (which any fault calls)."""
        if not self.alive:
            raise WorkerError("this pool was closed (a fault or an interrupted job); the next job starts a fresh one")
        if self._in_flight is not None:
            raise WorkerError(f"job {self._in_flight.number} is still in flight: collect it before the next")
        self._jobs += 1
        ticket = Ticket(self._jobs, time.monotonic(), timeout, job.describe())
        try:
            for conn in self._conns:
                conn.send((ticket.number, job))
        except OSError as error:
            self.close()
            raise WorkerError(f"the pool lost a rank while sending the job: {error}") from error
        except BaseException:
            self.close()
            raise
        self._in_flight = ticket
        return ticket

    def collect(self, ticket: Ticket) -> list[dict]:
        """Every rank's reply to the job ``ticket`` names, waiting up to its deadline."""
        try:
            replies = self._gather(ticket)
        except BaseException:
            self.close()
            raise
        self._in_flight = None
        return replies

    def _gather(self, ticket: Ticket) -> list:
        """Every rank's reply to the job: an error reply, a reply to another job, a dead rank, or a rank owing its
        reply that has made no progress for the ticket's timeout, raises."""
        with progress.waiting():
            return self._replies(ticket)

    def _replies(self, ticket: Ticket) -> list:
        job, started, timeout, what = ticket
        replies: dict[int, object] = {}
        while len(replies) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in replies]
            waitables = {self._conns[r]: r for r in pending}  # a dead rank's end reads as EOF
            left = progress.deadline(started, timeout, [self._progress(r) for r in pending]) - time.monotonic()
            ready = wait(list(waitables), timeout=left) if left > 0 else []
            if not ready:
                if left > 0:
                    continue  # the deadline moves with the pending ranks' progress meanwhile
                raise WorkerError(
                    f"{what}: rank(s) {', '.join(map(str, pending))} of {self.world_size} made no progress for "
                    f"{timeout:g} s, no step taken, nothing compiled, no model called in an evaluation (a hang, for "
                    f"example a collective the other ranks never joined); the pool was torn down; {RAISE_TIMEOUT}",
                    remote_traceback=self._stacks(pending),
                )
            for rank in sorted({waitables[w] for w in ready}):
                try:
                    answered, status, payload, said = self._conns[rank].recv()
                except EOFError:
                    raise self._death(what, rank) from None
                torch_output.deliver(torch_output.from_plain(said), f"rank {rank}", what)
                if answered != job:
                    raise WorkerError(f"{what}: rank {rank} answered job {answered} while job {job} was waiting "
                                      "(a protocol error); the pool was torn down")
                if status == "usage":
                    raise InvalidArgument(f"on worker rank {rank}: {payload}")
                if status == "error":
                    dead = _dead_peer(self._processes, rank, DEATH_GRACE)
                    if dead is not None:
                        died = self._death(what, dead)
                        raise RunDied(f"{died}; rank {rank} then raised {_exception_line(payload)}",
                                      remote_traceback=f"{died.remote_traceback}\n\nrank {rank}: {payload}".strip(),
                                      exit_code=died.exit_code)
                    raise WorkerError(f"{what}: rank {rank} raised {_exception_line(payload)}",
                                      remote_traceback=f"rank {rank}: {payload}", raised=True)
                replies[rank] = payload
        return [replies[r] for r in range(self.world_size)]

    def _progress(self, rank: int) -> float | None:
        """When rank ``rank`` last made progress (progress.py), None before it has said."""
        try:
            with open(progress_file(self._folder, rank), "rb") as stamp:
                return progress.last(stamp.fileno())
        except OSError:
            return None

    def _death(self, what: str, rank: int) -> RunDied:
        """Rank ``rank`` is gone: how it ended, and the frames faulthandler wrote where a fatal signal killed it."""
        process = self._processes[rank]
        reason = _exit_reason(process)
        try:
            with open(stack_file(self._folder, rank), errors="replace") as dump:
                frames = dump.read(FRAMES_LIMIT).strip()
        except OSError:
            frames = ""
        where = innermost_frame(frames)
        return RunDied(f"{what}: rank {rank} died ({reason})" + (f" in {where}" if where else ""),
                       remote_traceback=frames, exit_code=process.poll() or 0)

    def _stacks(self, ranks: list[int]) -> str:
        """Where each hung rank stands: its Python stack, dumped on SIGUSR1 by faulthandler."""
        for rank in ranks:
            try:
                self._processes[rank].send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        dumps = []
        for rank in ranks:
            try:
                with open(stack_file(self._folder, rank)) as dump:
                    dumps.append(f"rank {rank} stack when it timed out:\n{dump.read().strip()}")
            except OSError:
                dumps.append(f"rank {rank}: no stack could be read")
        return "\n\n".join(dumps)

    def close(self) -> None:
        """Stop every rank: politely if idle, by SIGKILL if it does not go within a second."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for process in self._processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                try:
                    process.wait(FORKER_ANSWER_SECONDS)
                except subprocess.TimeoutExpired:  # the forker does not answer (stopped, stuck): it goes, ranks with it
                    self._forker.retire()
        self._forker.kill_group(self._folder)  # a rank forked for a start that was interrupted before it was known
        for conn in self._conns:
            conn.close()
        self._conns, self._processes = [], []
        shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]


def _exception_line(traceback_text: str) -> str:
    """The first line of the exception a traceback ends with: the first line after the last frame (a ``  File``
    line and its indented source and carets), whose message may hold indented lines of its own (a module's repr)."""
    lines = traceback_text.rstrip().splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith('  File "')), default=-1)
    after = last_frame + 1
    while last_frame >= 0 and after < len(lines) and lines[after].startswith("    "):
        after += 1
    return lines[after] if after < len(lines) else lines[-1]


def _dead_peer(processes: list[ForkedRank], raised: int, grace: float) -> int | None:
    """A rank other than ``raised`` that has died or dies within ``grace`` seconds, else None.

    When a rank dies, its peers' collectives break and they raise; which the parent reads first is a
    race. The death is the cause, so it is what a fault names, whichever arrived first.
    """
    deadline = time.monotonic() + grace
    while True:
        dead = [rank for rank, process in enumerate(processes) if rank != raised and process.poll() is not None]
        if dead or time.monotonic() >= deadline:
            return min(dead, default=None)
        time.sleep(0.02)


def _exit_reason(process: ForkedRank) -> str:
    try:
        code = process.wait(1.0)
    except subprocess.TimeoutExpired:
        return "its connection closed while it still runs"
    return process.orphaned() or exit_words(code)


LOOPBACK = "lo"
FOLDER_PREFIX = "equivcheck-pool-"
CHECKPOINT_PREFIX = "equivcheck-checkpoint-"  # a resume's checkpoint between its segments (runners/resume.py)
ORPHANED_PREFIXES = (FOLDER_PREFIX, REFERENCE_PREFIX, CHECKPOINT_PREFIX)  # each followed by the pid of its maker
_pools: dict[tuple[str, int], WorkerPool] = {}


def remove_orphaned_folders() -> None:
    """Remove the folders (a pool's, a shared reference's) of processes that are gone. A process killed together
    with its ranks (SIGKILL, an OOM kill, a signal to every process) runs no exit handler and leaves no rank to
    clean up; each folder names its process, and one still running (another pytest-xdist worker's) keeps its own."""
    for prefix in ORPHANED_PREFIXES:
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*")):
            pid = os.path.basename(folder)[len(prefix):].partition("-")[0]
            if pid.isdigit() and not _running(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


_swept = False


def remove_orphaned_folders_once() -> None:
    """:func:`remove_orphaned_folders` at a process's first check, whether or not it starts a pool."""
    global _swept
    if not _swept:
        _swept = True
        remove_orphaned_folders()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def pool_for(backend: str, world_size: int) -> WorkerPool:
    """The warm pool for (backend, world size), started on first use or after a fault."""
    _refuse_inside_a_rank()
    key = (backend, world_size)
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close()
        ensure_room(world_size, _warm_pids())
        pool = _pools[key] = WorkerPool(backend, world_size)
    return pool


def start_forker() -> None:
    """Start this process's forker now, where a pool will soon be needed and this process has other work meanwhile;
    inside a rank, where no pool may start, the refusal comes here already."""
    _refuse_inside_a_rank()
    forker(START_TIMEOUT)


def _refuse_inside_a_rank() -> None:
    """A module that runs a check when imported would have every rank start a pool of its own (1, 3, 7, 15 ...
    processes): ranks never start pools."""
    inside = os.environ.get(INSIDE_RANK_VARIABLE)
    if inside is not None:
        raise InvalidArgument(
            f"a distributed check was started inside worker rank {inside} while it imported the case's module: "
            "that module runs a check when it is imported. Put the check under `if __name__ == \"__main__\":` "
            "(or inside a test function), so that importing the module only registers the case"
        )


def run_job(backend: str, world_size: int, job: Job, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
    return submit_job(backend, world_size, job, timeout)()


def _warm_pids() -> list[int]:
    """Every rank of this process's warm pools: what a new group's room is judged beside."""
    return [pid for other in _pools.values() for pid in other.pids]


def run_in_fresh_ranks(backend: str, world_size: int, job: Job, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
    """``job`` on ranks started for it alone, which end with it: a process a restart begins with (a resume's
    segment: nothing of an earlier job's random streams, caches or lazily made state survives in it)."""
    _refuse_inside_a_rank()
    ensure_room(world_size, _warm_pids())
    ranks = WorkerPool(backend, world_size)
    try:
        return ranks.run(job, timeout)
    finally:
        ranks.close()


class InFlight:
    """A job for a warm pool's ranks: call it for the replies, or ``abandon()`` it (a pool it was sent to is
    closed, so no reply left unread can answer a later job)."""

    def __init__(self, backend: str, world_size: int, job: Job, timeout: float) -> None:
        self._key, self._job, self._timeout = (backend, world_size), job, timeout
        self._pool: WorkerPool | None = None
        self._ticket: Ticket | None = None

    def send(self) -> None:
        pool = pool_for(*self._key)
        try:
            self._ticket = pool.submit(self._job, self._timeout)
        except BaseException:
            if not pool.alive:  # a failed send closed it; it is never reused
                _pools.pop(self._key, None)
            raise
        self._pool = pool

    def __call__(self) -> list[dict]:
        if self._pool is None:
            self.send()
        try:
            return self._pool.collect(self._ticket)
        except BaseException:  # the pool closed itself; it is never reused
            _pools.pop(self._key, None)
            raise

    def abandon(self) -> None:
        if self._pool is not None:
            self._pool.close()
            _pools.pop(self._key, None)


def submit_job(backend: str, world_size: int, job: Job, timeout: float = DEFAULT_TIMEOUT) -> InFlight:
    """Send ``job`` to the warm pool's ranks now; the returned job gives their replies when called.

    A process's first pool waits for its forker to import torch: until the forker is ready the job is sent when
    its replies are first asked for, so that this process works meanwhile (the reference, its own lazy imports)
    instead of waiting."""
    _refuse_inside_a_rank()
    in_flight = InFlight(backend, world_size, job, timeout)
    if forker(START_TIMEOUT).ready:
        in_flight.send()
    return in_flight


def shutdown_pools() -> None:
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


atexit.register(shutdown_pools)
