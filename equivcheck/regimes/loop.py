"""The micro-batch loop that every accumulating regime shares, faithful ones and pitfalls alike.

A pitfall differs from its faithful twin in one place: how a micro-batch's loss is weighted, what
touches the gradients before or after each backward, or what context each micro-batch runs in. So
each regime is written as that one difference, passed to the same loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import Tensor
from torch.optim import Optimizer

from ..case import Batch, Objective
from .base import finish_step, micro_batch_count

PartLoss = Callable[[Tensor, Tensor], Tensor]


def backward_chunks(
    forward: Callable[[Tensor, Tensor], object],
    inputs: Tensor,
    targets: Tensor,
    chunks: int,
    part_loss: PartLoss,
    *,
    retain_graph: bool = False,
    objective: Objective | None = None,
    around: Callable[[bool], AbstractContextManager] | None = None,
    after: Callable[[], object] | None = None,
) -> Tensor:
    """Back-propagate ``part_loss(forward(x, y), y)`` for each of ``chunks`` slices; return their summed loss.
    ``forward`` takes a micro-batch's inputs and targets (``objective.forward_of(model)``; ``inputs_only(head)``).

    With ``objective``, each backward goes through its GradScaler (a no-op unless the precision uses
    one). ``around(last)`` is the context a micro-batch's forward and backward run in (DDP's
    ``no_sync()`` on all but the last); ``after()`` runs after each backward.
    """
    count = micro_batch_count(len(targets), chunks)  # fewer for a smaller last batch; never an empty micro-batch
    pairs = list(zip(inputs.tensor_split(count), targets.tensor_split(count)))
    total = 0.0
    for i, (x, y) in enumerate(pairs):
        with around(i == len(pairs) - 1) if around else contextlib.nullcontext():
            part = part_loss(forward(x, y), y)
            if objective is None:
                part.backward(retain_graph=retain_graph)
            else:
                objective.backward(part, retain_graph=retain_graph)
        if after is not None:
            after()
        total = total + part.detach().double()  # summed in float64: a 16-bit sum of many parts rounds at each add
    return total


def accumulate(model: Callable[[Tensor], Tensor], optimizer: Optimizer, batch: Batch, objective: Objective,
               chunks: int, part_loss: PartLoss | None = None, *, max_norm: float = math.inf) -> Tensor:
    """Gradient accumulation: a backward per micro-batch (each its share of the global mean unless
    ``part_loss`` says otherwise), then one optimizer step (the sum clipped to ``max_norm`` first).
    Returns the step's loss."""
    loss = backward_chunks(objective.forward_of(model), batch.inputs, batch.targets, chunks,
                           part_loss or global_mean_part(objective, batch),
                           objective=objective)
    finish_step(optimizer, objective, max_norm)
    return loss


def inputs_only(module: Callable[[Tensor], object]) -> Callable[[Tensor, Tensor], object]:
    """A part of a model (a head on detached features) as the micro-batch loop calls it."""
    return lambda inputs, targets: module(inputs)


def global_mean_part(objective: Objective, batch: Batch) -> PartLoss:
    """A chunk's share of the global batch's objective (the mean of each of its terms over the whole batch)."""
    return lambda output, targets: objective.share(output, targets, batch)


def meddling_part(meddle: Callable[[], object], objective: Objective, batch: Batch) -> PartLoss:
    """A micro-batch's share of the global mean, taken after ``meddle()`` touched the gradients so far."""
    share = global_mean_part(objective, batch)

    def part(output: Tensor, targets: Tensor) -> Tensor:
        meddle()
        return share(output, targets)

    return part
