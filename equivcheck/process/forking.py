"""Whether this process may fork a child that trains.

On a machine with a GPU, a process's first backward starts autograd's device threads, and a child forked after that
cannot run backward at all; a process that has asked the CUDA runtime anything (even how many devices it has) leaves
its children unable to start CUDA. Only on a machine without a GPU is a fork of a process that may have trained a
child that can train.
"""

from __future__ import annotations

import os

import torch


def fork_is_safe() -> bool:
    """Whether a child forked from this process can train: only where this machine has no GPU, so that autograd never
    starts device threads here and no CUDA driver state is inherited (the module's docstring)."""
    if not hasattr(os, "fork"):
        return False
    return (torch.version.cuda is None and torch.version.hip is None) or not _has_gpu_without_asking_cuda()


def _has_gpu_without_asking_cuda() -> bool:
    """Whether a GPU is present, read from NVML where it can (asking the CUDA runtime would itself leave forked
    children unable to start CUDA), else from the runtime."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        counted = torch.cuda._device_count_nvml()  # -1: NVML could not tell
    except Exception:
        counted = -1
    return (counted if counted >= 0 else torch.cuda.device_count()) > 0
