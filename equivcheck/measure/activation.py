"""Peak activation memory of a training run: what autograd keeps alive for the backward pass.

People accumulate gradients to fit a batch in memory; whether a regime really saves memory is the
peak of what its graphs hold, not its code. Two meters, chosen by where the model lives:

- ``saved_tensors`` (CPU): exact and repeatable. Autograd's saved-tensor hooks see every tensor an
  operation saves for backward (the model's and the loss's); each storage counts once (a view of
  it, saved twice, adds nothing) while at least one saved tensor refers to it, and the storages that
  live anyway are left out: parameters, buffers and the case's data. The peak is the greatest total
  over the run. Tensors that only the training loop holds (an output kept in a variable) are not
  seen: the figure is what the graph keeps, the part that accumulation exists to cut.
- ``cuda_allocator`` (CUDA): the caching allocator's peak over the run above what was allocated when
  training began. It also holds gradients, optimizer state and temporaries, so it is larger than
  the saved-tensor figure and comparable only with itself.

Regions under their own saved-tensor hooks (activation checkpointing) are not counted: the
innermost hooks win, and what they keep is theirs to account for.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from ..process.torch_imports import is_dtensor

SAVED_TENSORS = "saved_tensors"
# torch.func's words where a transform (grad, vjp) meets a saved-tensor hook, which the meter below is
TRANSFORMS_REFUSE_HOOKS = "don't yet support saved tensor hooks"
CUDA_ALLOCATOR = "cuda_allocator"


class SavedTensorMeter(AbstractContextManager):
    """Count the bytes of the storages autograd saves for backward; keep the peak."""

    method = SAVED_TENSORS

    def __init__(self, live_anyway: Iterable[Tensor] = ()) -> None:
        self._left_out = {_local(t).untyped_storage().data_ptr() for t in live_anyway}
        self._saved: dict[int, list[int]] = {}  # storage address -> [saved tensors on it, its bytes]
        self.live = 0
        self.peak = 0

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: Tensor) -> _Saved:
        # Hold a detached alias: the tensor itself may own the graph node that holds this record,
        # a cycle the garbage collector cannot see, which would keep the storage alive forever.
        detached = tensor.detach()
        storage = _local(tensor).untyped_storage()  # a DTensor (tensor parallelism) saves its local shard
        address = storage.data_ptr()
        if address in self._left_out or storage.nbytes() == 0:
            return _Saved(detached, None, 0)
        entry = self._saved.get(address)
        if entry is None:
            self._saved[address] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Saved(detached, self, address)

    def _release(self, address: int) -> None:
        entry = self._saved[address]
        entry[0] -= 1
        if entry[0] == 0:
            del self._saved[address]
            self.live -= entry[1]


class _Saved:
    """What the graph holds instead of a saved tensor; it tells the meter when the graph lets go."""

    __slots__ = ("tensor", "_meter", "_address")

    def __init__(self, tensor: Tensor, meter: SavedTensorMeter | None, address: int) -> None:
        self.tensor = tensor
        self._meter = meter
        self._address = address

    def __del__(self) -> None:
        # A signal (the CLI's SIGTERM) can stop __init__ before _meter is set: that half-built record held
        # nothing, and a missing attribute here would print a traceback on the way out.
        meter = getattr(self, "_meter", None)
        if meter is not None:
            meter._release(self._address)


def _local(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this process holds: a sharded parameter's (FSDP2's DTensor) own shard, the tensor under
    a collective still in flight (a DTensor's local part may be one, measured under FSDP2 x TP on nested blocks: a
    wrapper with no storage of its own)."""
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    return local.elem if type(local).__name__ == "AsyncCollectiveTensor" else local


def _unpack(saved: _Saved) -> Tensor:
    return saved.tensor


class CudaAllocatorMeter(AbstractContextManager):
    """The CUDA caching allocator's peak over the block, above what was allocated at its start."""

    method = CUDA_ALLOCATOR

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.peak = 0

    def __enter__(self) -> CudaAllocatorMeter:
        torch.cuda.synchronize(self._device)
        self._start = torch.cuda.memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self._device)
        self.peak = torch.cuda.max_memory_allocated(self._device) - self._start


class NoMeter(AbstractContextManager):
    """Measurement switched off: no figure, no cost."""

    method = None
    peak = None

    def __exit__(self, *exc: object) -> None:
        pass


def activation_meter(model: nn.Module, data: Iterable[Tensor], *, enabled: bool = True) -> AbstractContextManager:
    """The meter for where ``model`` lives; ``data`` (the case's batches) is left out of the count."""
    if not enabled:
        return NoMeter()
    device = next(model.parameters()).device
    if device.type == "cuda":
        return CudaAllocatorMeter(device)
    return SavedTensorMeter([*model.parameters(), *model.buffers(), *data])
