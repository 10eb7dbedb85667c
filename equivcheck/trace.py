"""What one replayed optimizer step leaves at its module boundaries (recorded by :mod:`equivcheck.runners.tracing`,
read by :mod:`equivcheck.judge.locate`): plain CPU tensors, one trace per rank.

A mismatch asks where the run first left its reference. The answer needs more than the gradients the optimizer
read: every module's inputs and outputs, the gradients of its output and of its inputs, what backward delivered to
each parameter, the weights the step started from. Only the first step that parts is traced, and only when a
check failed: an equivalent check records none of this.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from .arrays import from_array, to_array


@dataclasses.dataclass
class ModuleCall:
    """One call of one module in the traced step: its floating inputs and outputs (flattened in order), the gradient
    each output received and the gradient it passed to each input that needed one (None where none arrived),
    accumulated over every backward pass that reached this call (a retained graph's several). ``integers`` holds
    its integer inputs (token ids): two runs fed other tokens differ there."""

    module: str
    index: int  # this module's how-manieth call in the step (micro-batches, tied weights, an RNN's time steps)
    inputs: list[Tensor | None]  # None: an input that is no floating tensor
    outputs: list[Tensor]
    integers: list[Tensor] = dataclasses.field(default_factory=list)
    grad_outputs: list[Tensor | None] = dataclasses.field(default_factory=list)
    grad_inputs: list[Tensor | None] = dataclasses.field(default_factory=list)
    # the random generator's state as the call began, where the call drew from it (dropout): a call fed the same
    # input draws another mask only from another state
    random_state: Tensor | None = None
    computed_in: str = ""  # the dtype of its first floating output as the run computed it ("torch.bfloat16")


@dataclasses.dataclass
class StepTrace:
    """One rank's record of optimizer step ``step`` (the whole run in one process has one rank).

    ``calls`` are in the order their forwards finished (a child before its parent); ``backward_order`` lists each
    call's ``(module, index)`` in the order its input gradients arrived (a child's before its parent's).
    ``delivered``: what backward passes delivered to each parameter in the step, summed, as this rank holds it
    (before any all-reduce, clipping or hook that runs after backward); ``read``: the gradients as the optimizer read
    them on this rank. ``weights_before`` (as the step's first forward began) are whole (the regime's read-back);
    ``hyper`` holds each parameter group's numeric settings as the step used them. ``broken``: why some records are
    missing (a hook that could not run), else ""."""

    step: int
    rank: int
    calls: list[ModuleCall]
    backward_order: list[tuple[str, int]]
    delivered: dict[str, Tensor]
    read: dict[str, Tensor]
    weights_before: dict[str, Tensor]
    hyper: list[dict[str, float]]
    root_inputs: list[Tensor] = dataclasses.field(default_factory=list)  # what this rank fed the model, ids too
    # the optimizer's state as the step began ("fc.weight/exp_avg"), as this rank holds it
    optimizer_state: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    # every floating buffer of the traced modules as the step began, persistent or not ("blocks.1.gate.calls"), as
    # this rank holds it: what carried into the step besides the weights and the optimizer (a counter such as
    # BatchNorm's num_batches_tracked counts forwards, which regimes make otherwise on purpose)
    buffers_before: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    loss_scale: float = 1.0  # what a GradScaler multiplied the step's loss by: its activation gradients carry it
    # where each read gradient this rank holds a part of (a DTensor's shard) lies in the whole: (its shape, the part's
    # offset); the localizer joins the ranks' parts by it
    placed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # what the last backward pass that reached each parameter delivered to it, as this rank holds it: where the
    # optimizer read this alone, the passes before it were dropped (an accumulator reset between micro-batches)
    last_pass: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    # what the collectives of a sharded parameter (a DTensor's: FSDP2's reduce-scatter) left in its gradient, summed
    # over the step, as this rank holds it: what the optimizer read should be this, unless the step changed it after
    reduced: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    broken: str = ""

    def to_plain(self) -> dict:
        """Numpy arrays and builtins only: what crosses from a rank or a forked child."""
        return _mapped(dataclasses.asdict(self), Tensor, to_array)

    @classmethod
    def from_plain(cls, plain: dict) -> StepTrace:
        fields = _mapped(plain, np.ndarray, from_array)
        fields["calls"] = [ModuleCall(**call) for call in fields["calls"]]
        fields["backward_order"] = [tuple(key) for key in fields["backward_order"]]
        fields["placed"] = {name: (tuple(shape), tuple(offset)) for name, (shape, offset) in fields["placed"].items()}
        return cls(**fields)


def _mapped(value, kind: type, convert):
    """``value`` with every ``kind`` inside its dicts, lists and tuples converted."""
    if isinstance(value, kind):
        return convert(value)
    if isinstance(value, dict):
        return {key: _mapped(item, kind, convert) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(item, kind, convert) for item in value)
    return value
