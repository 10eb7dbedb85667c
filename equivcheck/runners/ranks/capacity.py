"""Refuse a world size this machine cannot hold, before spawning it.

Every rank is a whole interpreter with torch loaded (about 300-400 MB here, the case's model and
data on top), so ``world_size=256`` would exhaust memory long before anything said no. The size of
a rank is measured: a live rank of any pool if there is one, else this process, which has imported
the same torch and the same case.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import Unavailable


def ensure_room(world_size: int, live_rank_pids: Iterable[int]) -> None:
    """Raise :class:`Unavailable` when ``world_size`` ranks of the measured size exceed available memory."""
    available = available_bytes()
    sizes = [size for size in map(resident_bytes, live_rank_pids) if size]
    per_rank = max(sizes) if sizes else resident_bytes("self")
    if available is None or per_rank is None:  # no /proc: nothing to measure, nothing refused
        return
    if world_size * per_rank > available:
        raise Unavailable(
            f"world_size={world_size} needs about {world_size} x {per_rank / 2**20:.0f} MiB = "
            f"{world_size * per_rank / 2**30:.1f} GiB (one interpreter with torch per rank, measured), and this "
            f"machine has {available / 2**30:.1f} GiB available"
        )


def resident_bytes(pid: int | str) -> int | None:
    """The resident set of process ``pid`` (``'self'``: this one), from /proc."""
    return _kib_field(f"/proc/{pid}/status", "VmRSS:")


def available_bytes() -> int | None:
    return _kib_field("/proc/meminfo", "MemAvailable:")


def _kib_field(path: str, field: str) -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
