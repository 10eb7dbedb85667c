"""A team's own training code as a regime, so CI can gate it against a reference.

``check_step(case, step)`` runs ``step(model, optimizer, (inputs, targets))`` once per global batch
of the case, from the same seeded start as the reference, and compares every gradient (taken when
the step calls ``optimizer.step()``), the final weights and the losses. ``check_loop`` does the
same for a function that runs a whole loop over the batches (schedulers and other state that lives
across steps belong there). The step returns the global batch's mean loss, or None to leave losses
out of the comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

from .case import Batch, Case, Objective
from .check import Report, check
from .ddp_step import DdpStep, import_path
from .errors import InvalidArgument, expect_callable
from .regimes import Regime

StepFn = Callable[[nn.Module, Optimizer, tuple[Tensor, Tensor]], object]
LoopFn = Callable[[nn.Module, Optimizer, list[tuple[Tensor, Tensor]]], "Iterable[object] | None"]


def _label(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@dataclasses.dataclass(frozen=True)
class UserCode(Regime):
    """A regime whose work is done by the team's function ``fn``; named after it (``step:my_step``)."""

    fn: Callable

    def __post_init__(self) -> None:
        expect_callable(self.name, self.fn)

    def __str__(self) -> str:
        return f"{self.name}:{_label(self.fn)}"


@dataclasses.dataclass(frozen=True)
class UserStep(UserCode):
    """One optimizer step on one global batch, computed by the team's own ``fn``."""

    name = "step"
    summary = "a team's own step function: one optimizer step on one global batch"

    def train_step(self, model, optimizer, batch: Batch, objective: Objective):
        return self.fn(model, optimizer, (batch.inputs, batch.targets))


@dataclasses.dataclass(frozen=True)
class UserLoop(UserCode):
    """The team's own loop over every global batch; it returns one loss per batch, or None."""

    name = "loop"
    summary = "a team's own training loop over the global batches"

    def train(self, model, optimizer, batches: Sequence[Batch], objective: Objective):
        losses = self.fn(model, optimizer, [(b.inputs, b.targets) for b in batches])
        if losses is None:
            return [None] * len(batches)
        losses = list(losses)
        if len(losses) != len(batches):
            raise InvalidArgument(
                f"loop {_label(self.fn)!r} returned {len(losses)} losses for {len(batches)} global batches: "
                "expected one loss per batch, or None"
            )
        return losses


def check_step(
    case: Case | str,
    step: StepFn,
    reference: str | Regime | StepFn = "full_batch",
    *,
    world_size: int | None = None,
    **options,
) -> Report:
    """Check a team's ``step(model, optimizer, batch)`` against ``reference``: a regime spec, or another
    step function (the code before a refactor, or full batch with the same clipping).

    With ``world_size`` the step runs on that many DDP ranks of the warm pool (see ``ddp_step``).
    ``options`` go to :func:`equivcheck.check` (rtol, atol, seed, backend, timeout).
    """
    reference = reference if isinstance(reference, (str, Regime)) else UserStep(reference)
    if world_size is None:
        candidate = UserStep(step)
    else:
        expect_callable("step", step)
        candidate = DdpStep(world_size=world_size, fn=import_path(step))
    return check(case, [candidate], reference=reference, **options)


def check_loop(
    case: Case | str, loop: LoopFn, reference: str | Regime | LoopFn = "full_batch", **options
) -> Report:
    """Check a team's ``loop(model, optimizer, batches)`` against ``reference`` (a spec or another loop)."""
    reference = reference if isinstance(reference, (str, Regime)) else UserLoop(reference)
    return check(case, [UserLoop(loop)], reference=reference, **options)
