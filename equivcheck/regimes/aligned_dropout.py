"""Dropout on ranks: each rank draws the masks one process draws for the whole global batch, and keeps its own part.

One process trains a global batch in one forward, each dropout call drawing a mask of the batch's shape. A rank holds
a shard of that batch (a micro-batch of the shard, under accumulation; a slice of the features, under tensor
parallelism), and a mask of the shard's shape drawn from the same stream is another mask: the check would report
dropout itself. So on a rank every dropout call draws the mask of the *global* shape, from the state its step began at
(every rank is seeded alike, as every run is), and multiplies its input by its own part of it: the rows of the global
batch its forward's inputs are (a rank's shard and its micro-batches are views of the global batch, so their storage
offset says where they start), and under tensor parallelism a DTensor's own slice of its global shape. Each forward of
a step draws from the step's starting state again, so micro-batches apply the same masks; a checkpointed recomputation
restores the state it saved, so it draws them again too. ``dropout(ones)`` is the scaled mask itself and CPU dropout
is ``input * mask``: a rank's product is, element for element, the one a single process computes.

What cannot be placed is an error that says why, never other masks: a forward whose inputs are no slice of a global
batch, a dropout input that does not hold the forward's rows on dim 0, an attention kernel's own ``dropout_p``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

from ..errors import DropoutNotPlaced
from ..process.torch_imports import is_dtensor

MASKED = ("dropout", "dropout1d", "dropout2d", "dropout3d")  # input * a mask drawn by shape: each can be placed


@functools.cache
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def rows_in(inputs: object, batches: Sequence[Tensor]) -> tuple[int, int, int] | None:
    """Where ``inputs`` lies in the global batch it is a slice of: (first row, rows, the global batch's rows); None
    where it is no slice of one (a copy, a tensor the step built)."""
    if not isinstance(inputs, Tensor):
        return None
    for whole in batches:
        if inputs is whole:
            return 0, len(whole), len(whole)
        if (whole.dim() == inputs.dim() >= 1 and whole.stride(0) > 0 and inputs.shape[1:] == whole.shape[1:]
                and inputs.stride() == whole.stride() and inputs.device == whole.device
                and inputs.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()):
            first, rest = divmod(inputs.storage_offset() - whole.storage_offset(), whole.stride(0))
            if not rest and 0 <= first and first + len(inputs) <= len(whole):
                return first, len(inputs), len(whole)
    return None


class AlignedDropout:
    """Where a rank's forwards lie in the global batches, and dropout placed there; :func:`aligned_dropout` installs it
    around a run's training."""

    def __init__(self, batches: Sequence[Tensor], regime: str) -> None:
        self._batches, self._regime = batches, regime
        self._step_state: Tensor | None = None  # the generator's state when this step's first forward began
        self._rows: tuple[int, int, int] | None = None  # the running forward's place in its global batch
        self._device: torch.device | None = None
        self._current = 0  # the global batch the last forward was in

    def before_forward(self, module: nn.Module, args: tuple) -> None:
        """A forward of the model: the first of a step notes the generator's state, a later one goes back to it."""
        inputs = args[0] if args else None
        self._device = inputs.device if isinstance(inputs, Tensor) else self._device
        if self._step_state is None:
            self._step_state = _generator_state(self._device)
        else:
            _set_generator_state(self._device, self._step_state)
        self._rows = self._located(inputs)

    def _located(self, inputs: object) -> tuple[int, int, int] | None:
        """:func:`rows_in` the global batches, from the one the last forward was in: a run takes its batches in turn,
        so a long run finds each forward's batch at once, not after every batch before it."""
        count = len(self._batches)
        for step in range(count):
            index = (self._current + step) % count
            rows = rows_in(inputs, self._batches[index:index + 1])
            if rows is not None:
                self._current = index
                return rows
        return None

    def after_step(self, *_) -> None:
        """The optimizer stepped: the next forward starts the next global batch, from where the draws have left off."""
        self._step_state = None

    def placing(self, dropout):
        """``dropout`` (``F.dropout``, ``F.dropout2d``, ...) drawing the global shape's mask and applying this rank's
        part of it."""

        @functools.wraps(dropout)
        def placed(*args, **kwargs):
            bound = _signature(dropout).bind(*args, **kwargs)
            bound.apply_defaults()
            x, p, training, inplace = (bound.arguments[name] for name in ("input", "p", "training", "inplace"))
            if not training or p == 0:
                return dropout(*args, **kwargs)
            local = x.to_local() if is_dtensor(x) else x
            shape, part = self._placed(x)
            mask = dropout(torch.ones(shape, dtype=local.dtype, device=local.device), p, True)[part]
            if not is_dtensor(x):
                return x.mul_(mask) if inplace else x * mask
            from torch.distributed.tensor import DTensor

            if inplace:
                local.mul_(mask)
                return x
            return DTensor.from_local(local * mask, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                      stride=x.stride())

        return placed

    def refusing(self, attention):
        """``scaled_dot_product_attention``, refusing a ``dropout_p`` of its own: its kernel draws the mask inside."""

        @functools.wraps(attention)
        def refused(*args, **kwargs):
            dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)  # (q, k, v, attn_mask, dropout_p)
            if dropout_p > 0:
                raise DropoutNotPlaced(
                    f"dropout under {self._regime}: scaled_dot_product_attention(dropout_p={dropout_p}) draws its "
                    "mask inside the attention kernel, where no rank can draw the global batch's: expected "
                    "dropout_p=0 in the case's attention (an nn.Dropout on the attention weights can be placed)")
            return attention(*args, **kwargs)

        return refused

    def _placed(self, x: Tensor) -> tuple[list[int], tuple[slice, ...]]:
        """The global shape a dropout input is a part of, and the slices that are its part."""
        if self._rows is None:
            raise DropoutNotPlaced(
                f"dropout under {self._regime}: this forward's inputs are no slice of a global batch (a copy, a "
                "tensor the step built, or a part of the model called on its own), so no rank can tell which rows of "
                "the global batch's masks are its own: expected the model called on the (micro-)batch the regime "
                "hands it")
        first, rows, total = self._rows
        if is_dtensor(x):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            sizes, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        else:
            sizes, offsets = tuple(x.shape), (0,) * x.dim()
        shape = list(x.shape)
        if rows != total:  # this forward holds part of the batch: its rows are dim 0 of every dropout input
            if not shape or shape[0] != rows:
                raise DropoutNotPlaced(
                    f"dropout under {self._regime}: an input of shape {tuple(shape)} does not hold this forward's "
                    f"{rows} rows of the global batch on dim 0, so no rank can tell which rows of the global mask "
                    "are its own: expected dropout inputs with the batch first")
            shape[0] = total
            offsets = (offsets[0] + first, *offsets[1:])
        return shape, tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes))


@contextlib.contextmanager
def aligned_dropout(model: nn.Module, optimizer: Optimizer, batches: Sequence[Tensor], regime: str) -> Iterator[None]:
    """Train with dropout placed in the global batch's masks: ``model``'s forwards found in ``batches`` (each global
    batch's inputs), ``optimizer``'s steps ending each step's draws. ``torch.nn.functional``'s dropouts are replaced
    for the run, not intercepted by a mode: a checkpointed block recomputed in the backward calls them again where no
    torch function mode reaches."""
    aligned = AlignedDropout(batches, regime)
    replaced = {name: getattr(F, name) for name in (*MASKED, "scaled_dot_product_attention")}
    handles = (model.register_forward_pre_hook(aligned.before_forward, prepend=True),
               optimizer.register_step_post_hook(aligned.after_step))
    for name, original in replaced.items():
        setattr(F, name, aligned.refusing(original) if name == "scaled_dot_product_attention" else
                aligned.placing(original))
    try:
        yield
    finally:
        for name, original in replaced.items():
            setattr(F, name, original)
        for handle in handles:
            handle.remove()


def _generator_state(device: torch.device | None) -> Tensor:
    if device is not None and device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.default_generator.get_state()


def _set_generator_state(device: torch.device | None, state: Tensor) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.default_generator.set_state(state)
