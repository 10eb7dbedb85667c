"""What one rank holds of the training state: parameter, gradient and optimizer-state bytes.

A sharding wrapper (FSDP2's DTensor parameters, ZeRO's optimizer partitions) keeps about 1/W of what
DDP replicates on every rank; counting the bytes a rank really holds is how that shows.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.optim import Optimizer

from ..process.torch_imports import is_dtensor


def held_bytes(tensors: Iterable[Tensor | None]) -> int:
    """The bytes of the part of each tensor this rank holds (a DTensor's local shard)."""
    local = (t.to_local() if is_dtensor(t) else t for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in local)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Every tensor in the optimizer's per-parameter state (Adam's moments, momentum buffers; step counters too)."""
    return held_bytes(value for state in optimizer.state.values() for value in state.values()
                      if isinstance(value, Tensor))
