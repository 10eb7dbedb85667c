"""Closure steps (``optimizer.step(closure)``) as a step pre-hook sees them.

Lightning's automatic optimisation, LBFGS and hand-written closures run the last forward and backward
inside ``step``, after the step pre-hooks where equivcheck records gradients: recorded there, they
miss the last micro-batch. :func:`evaluate_closure` lets a pre-hook run the closure itself, at the
point where the optimizer would, and hand the optimizer a closure that returns that result on its first
call. Nothing runs twice, so no gradient is doubled; the hooks after it see the gradients the optimizer
steps with. Later calls (LBFGS re-evaluates within one step) run the team's closure for real.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def evaluate_closure(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Given a step pre-hook's ``args`` (the optimizer first) and ``kwargs``: None where the step has no
    closure, else run the closure now (with gradients on, as torch's optimizers do) and return the
    call's arguments with the closure replaced by :func:`replaying` its result."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is None:
        return None
    with torch.enable_grad():
        result = closure()
    if len(args) > 1:
        return (args[0], replaying(result, closure), *args[2:]), kwargs
    return args, {**kwargs, "closure": replaying(result, closure)}


def replaying(result: object, closure: Callable[[], object]) -> Callable[[], object]:
    """A closure that returns ``result`` on its first call and runs ``closure`` on every later one."""
    pending = [result]

    def replay() -> object:
        return pending.pop() if pending else closure()

    return replay
