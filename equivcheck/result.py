"""What one training run leaves behind: plain CPU tensors, detached from any graph or process."""

from __future__ import annotations

import dataclasses

from torch import Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class RunResult:
    """Per-step losses and gradients (taken just before each ``optimizer.step``), final state.

    ``grads`` has one entry per optimizer step the regime took, so a regime that steps per
    micro-batch shows up as a different step count. ``buffers`` holds floating buffers such as
    BatchNorm running statistics.
    """

    case: str
    regime: str
    losses: tuple[float | None, ...]
    grads: tuple[dict[str, Tensor], ...]
    weights: dict[str, Tensor]
    buffers: dict[str, Tensor]
    seconds: float
    precision: str = ""  # the precision mode's name (equivcheck.precision); "" means the weights' dtype

    @property
    def optimizer_steps(self) -> int:
        return len(self.grads)
