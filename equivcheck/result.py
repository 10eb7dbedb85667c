"""What one training run leaves behind: plain tensors, detached from any graph or process, in the host's memory (an
anchored check's reference on a GPU keeps its own there: :meth:`RunResult.to`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .arrays import from_array, to_array

from .trace import StepTrace

if TYPE_CHECKING:
    from .diff import Measurement

_TENSOR_MAPS = ("weights", "buffers")


@dataclasses.dataclass(frozen=True, eq=False)
class RunResult:
    """Per-step losses and gradients (taken just before each ``optimizer.step``), final state.

    ``grads`` has one entry per optimizer step the regime took, so a regime that steps per
    micro-batch shows up as a different step count. ``buffers`` holds floating buffers such as
    BatchNorm running statistics. Distributed runs add, per optimizer step, how many gradient
    synchronisations (DDP all-reduce rounds) and bytes each rank sent, and how far the ranks'
    final weights ended apart (0 when DDP kept them identical) and, per step, how far each rank's
    gradients were from rank 0's as the optimizer took them (``rank_grad_spread``: all 0 when they
    were all-reduced). ``peak_activation_bytes`` is the
    run's peak activation memory (rank 0's in a distributed run), measured by ``memory_method``
    (see :mod:`equivcheck.measure.activation`); ``None`` where it was not measured.
    """

    case: str
    regime: str
    losses: tuple[float | None, ...]
    grads: tuple[dict[str, Tensor], ...]
    weights: dict[str, Tensor]
    buffers: dict[str, Tensor]
    seconds: float
    syncs: tuple[int, ...] | None = None
    sync_bytes: tuple[int, ...] | None = None
    sync_wrappers: int | None = None  # the DDP wrappers counted: a model wrapped in parts has several
    # Every counted collective of each step by kind, "all_reduce" (DDP: one call per bucket) or "reduce_scatter"
    # and "all_gather" (FSDP2): (calls, bytes this rank handed over).
    collectives: tuple[dict[str, tuple[int, int]], ...] | None = None
    rank_spread: float | None = None
    rank_drift: str = ""  # where the ranks' weights ended furthest apart: "'2.bias', rank 1 against rank 0"
    rank_grad_spread: tuple[tuple[float, ...], ...] | None = None  # [step][rank]: max |grad - rank 0's grad|
    precision: str = ""  # the precision mode's name (equivcheck.precision); "" means the weights' dtype
    peak_activation_bytes: int | None = None
    memory_method: str | None = None
    loss_dtypes: tuple[str, ...] = ()  # the dtypes the case's loss came out in ("torch.float32"): the real precision
    steps_per_batch: tuple[int, ...] | None = None  # optimizer steps each global batch took, where observable
    batch_samples: tuple[int, ...] = ()  # samples in each global batch trained on, every epoch's: where the tails are
    # Bytes rank 0 held (parameters, gradients at the last step, optimizer state): see equivcheck.measure.state.
    state_bytes: tuple[int, int, int] | None = None
    grad_norms: tuple[float, ...] = ()  # each step's global gradient norm, where the regime clips (check.py's note)
    # A run compared with a reference as it trained (training.train's against=): every difference measured, and
    # no gradient, weight or buffer kept (``grads`` holds an empty mapping per step).
    measured: Measurement | None = None
    # A replay's record of the one step it traced, one per rank (runners/tracing.py); () for every other run.
    traces: tuple[StepTrace, ...] = ()

    @property
    def optimizer_steps(self) -> int:
        return len(self.grads)

    @property
    def recorded_bytes(self) -> int:
        """What this run's recording holds: every step's gradients, the final weights and buffers."""
        maps = [*self.grads, self.weights, self.buffers]
        return sum(t.numel() * t.element_size() for named in maps for t in named.values())

    def to(self, device: torch.device) -> RunResult:
        """This run with its recording (gradients, weights, buffers) on ``device``: itself where it is there already.
        An anchored check's reference keeps its recording on its GPU; what reads it whole reads it here."""
        def moved(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
            return {name: t.to(device) for name, t in tensors.items()}

        if all(t.device == device for named in (*self.grads, self.weights, self.buffers) for t in named.values()):
            return self
        return dataclasses.replace(self, grads=tuple(moved(step) for step in self.grads), weights=moved(self.weights),
                                   buffers=moved(self.buffers))

    def to_plain(self) -> dict:
        """Numpy arrays and builtins only: safe to pickle across processes (no shared-memory tensors)."""
        plain = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        plain["grads"] = [_to_numpy(step) for step in self.grads]
        for field in _TENSOR_MAPS:
            plain[field] = _to_numpy(plain[field])
        plain["traces"] = [trace.to_plain() for trace in self.traces]
        return plain

    @classmethod
    def from_plain(cls, plain: dict) -> RunResult:
        fields = dict(plain)
        fields["grads"] = tuple(_to_torch(step) for step in plain["grads"])
        for field in _TENSOR_MAPS:
            fields[field] = _to_torch(plain[field])
        fields["traces"] = tuple(StepTrace.from_plain(trace) for trace in plain.get("traces", ()))
        for field in ("losses", "syncs", "sync_bytes"):
            fields[field] = None if plain[field] is None else tuple(plain[field])
        return cls(**fields)


def _to_numpy(tensors: dict[str, Tensor]) -> dict[str, np.ndarray]:
    return {name: to_array(t) for name, t in tensors.items()}


def _to_torch(arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
    return {name: from_array(a) for name, a in arrays.items()}
