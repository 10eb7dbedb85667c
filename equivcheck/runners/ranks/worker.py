"""The worker rank: join the pool's process group once, then answer the jobs the pool sends (``jobs``: a
training run or an evaluation, each of which answers itself)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import shutil
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ...errors import InvalidArgument
from ...process import progress
from ...process import threads as intra_op
from ...process import torch_output
from ...process.exit import leave_with_parent


INSIDE_RANK_VARIABLE = "EQUIVCHECK_INSIDE_RANK"  # set in every rank: ranks never start pools of their own


def worker_main(rank: int, world_size: int, backend: str, store: str, conn: Connection, parent: int,
                threads: int, start_timeout: float) -> None:
    os.environ[INSIDE_RANK_VARIABLE] = str(rank)
    # A parent killed without its cleanup leaves its pool's folder to the ranks to remove.
    leave_with_parent(parent, lambda: shutil.rmtree(os.path.dirname(store), ignore_errors=True))
    # On SIGUSR1 (sent by the pool when a job times out) dump this rank's stack where the pool can read it, and
    # the frames it stood in where a fatal signal (SIGSEGV, SIGILL) kills it: what the pool's error then quotes.
    stacks = open(stack_file(os.path.dirname(store), rank), "w")  # noqa: SIM115 (lives as long as the rank)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=False)
    # Where this rank's progress goes (a step taken, a graph compiled): the pool times a job out on silence alone.
    progress.report_to(os.open(progress_file(os.path.dirname(store), rank), os.O_WRONLY | os.O_CREAT, 0o600))
    # A terminal's Ctrl-C is the parent's to handle (it closes the pool): a rank in a session of its own meets only a
    # SIGINT sent to it alone, as an isolated run's child ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    intra_op.pin(threads)  # ranks share the cores: every run on the count the pool gives them
    with torch_output.catching() as caught:
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=start_timeout))
        except Exception:
            conn.send((0, "error", traceback.format_exc(), torch_output.plain(caught)))
            return
    conn.send((0, "ready", None, torch_output.plain(caught)))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone without stopping its pool: its folder is left to the ranks
            shutil.rmtree(os.path.dirname(store), ignore_errors=True)
            break
        if message is None:
            break
        number, job = message  # every reply names the job it answers
        if not reply(conn, number, job.answer):
            break
    dist.destroy_process_group()


def reply(conn: Connection, number: int, work: Callable[[], dict]) -> bool:
    """Send the answer to job ``number``: its result, a usage error or a traceback, with torch's warnings and log
    records raised meanwhile (torch_output: the parent gathers or prints them; they never reach the terminal from
    here). False when the parent has stopped listening (Ctrl-C, SIGTERM): the rank then leaves quietly, never
    printing a traceback of its own broken pipe onto the terminal the parent shares."""
    try:
        with torch_output.catching() as caught:
            try:
                answer = (number, "ok", work())
            except InvalidArgument as error:  # a usage error, wherever it surfaced
                answer = (number, "usage", str(error))
            except Exception:
                answer = (number, "error", traceback.format_exc())
        try:
            conn.send((*answer, torch_output.plain(caught)))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception:  # the answer would not cross (it does not pickle): its traceback does
            conn.send((number, "error", traceback.format_exc(), torch_output.plain(caught)))
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def stack_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.stack")


def progress_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.progress")
