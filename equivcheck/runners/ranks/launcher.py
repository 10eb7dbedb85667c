"""Under a launcher (torchrun sets RANK and WORLD_SIZE) the DDP regimes run in its process group.

Every rank runs the same checks in the same order, so the collectives line up; rank 0 reports.
The same check then scales to real GPUs and nodes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ...errors import Unavailable
from .jobs import Job


def active() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def ensure_group(backend: str) -> None:
    """Join the launcher's process group once (rendezvous from its MASTER_ADDR / MASTER_PORT)."""
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)


def run_job(backend: str, world_size: int, job: Job) -> list[dict]:
    """Run ``job`` on this rank; its world size must be the launcher's. Returns every rank's reply."""
    launched = int(os.environ["WORLD_SIZE"])
    if world_size != launched:
        raise Unavailable(f"the launcher started {launched} ranks; this regime needs world_size={world_size}")
    ensure_group(backend)
    if dist.get_backend() != backend:
        raise Unavailable(f"the launcher's process group uses {dist.get_backend()}; this regime asks for {backend}")
    replies: list[dict | None] = [None] * world_size
    dist.all_gather_object(replies, job.answer())
    return replies


def leave_group() -> None:
    """Leave the launcher's process group, if this process joined one."""
    if active() and dist.is_initialized():
        dist.destroy_process_group()
