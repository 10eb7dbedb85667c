"""What the fault tests ask of the operating system about the processes a pool started."""

import os


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie has exited, only its parent has yet to reap it."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
