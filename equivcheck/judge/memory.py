"""Does a regime save the memory it is used for? Its peak activation memory against the reference's.

People accumulate gradients to fit a batch in memory. A regime that cuts the batch into micro-batches
but keeps every graph alive (seed 002's ``loss += item_loss``) is exact and saves nothing: the
harness says so, and ``Report.assert_saves_memory`` lets a team's CI gate on the ratio.
"""

from __future__ import annotations

import dataclasses

from ..result import RunResult

SAVES_NOTHING = "accumulates gradients but saves no memory"


@dataclasses.dataclass(frozen=True)
class MemoryUse:
    """One run's peak activation memory beside the reference's, measured the same way."""

    peak_bytes: int | None
    reference_bytes: int | None
    method: str | None
    accumulates: bool

    @classmethod
    def of(cls, accumulates: bool, result: RunResult, reference: RunResult) -> MemoryUse:
        """``accumulates``: the regime cuts its batch into several micro-batches, presumably to save memory."""
        same_method = result.memory_method == reference.memory_method
        return cls(result.peak_activation_bytes, reference.peak_activation_bytes if same_method else None,
                   result.memory_method, accumulates)

    @property
    def ratio(self) -> float | None:
        """Peak over the reference's peak; None where either is unmeasured or the reference holds nothing."""
        if self.peak_bytes is None or not self.reference_bytes:
            return None
        return self.peak_bytes / self.reference_bytes

    @property
    def note(self) -> str:
        """``SAVES_NOTHING`` for a regime that accumulates yet peaks at least as high as the reference."""
        saves_nothing = self.accumulates and self.ratio is not None and self.ratio >= 1
        return SAVES_NOTHING if saves_nothing else ""

    def describe(self) -> str:
        if self.peak_bytes is None:
            return "peak activation memory not measured"
        ratio = "" if self.ratio is None else f" = {self.ratio:.3f}x the reference's {format_bytes(self.reference_bytes)}"
        note = f"; {self.note}" if self.note else ""
        return f"peak activation memory {format_bytes(self.peak_bytes)}{ratio} ({self.method}){note}"


def format_bytes(count: int) -> str:
    """``960 B``, ``11.6 KiB``, ``2.3 MiB``."""
    if count < 1024:
        return f"{count} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}"
