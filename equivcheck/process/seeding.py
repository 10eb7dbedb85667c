"""The one place where randomness is seeded, so every regime starts from the same state."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..errors import expect_seed

DEFAULT_SEED = 0


@contextmanager
def seeded(seed: int = DEFAULT_SEED) -> Iterator[None]:
    """Seed python, numpy and torch for the block, and give the caller's RNG states back after."""
    expect_seed(seed)
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed)
        seed_torch(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def seed_torch(seed: int) -> None:
    """``torch.manual_seed``, which also queues a seed (with a stack trace) for every accelerator kind:
    a tenth of a millisecond a run. With no accelerator here, the CPU generator is all there is to seed."""
    if torch.accelerator.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
