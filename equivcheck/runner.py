"""The in-process runner: train a case under one regime from the seeded start, record everything."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .case import Batch, Case, Objective
from .errors import InvalidArgument
from .regimes import Regime, parse_regime
from .registry import resolve_case
from .result import RunResult
from .seeding import DEFAULT_SEED, default_dtype, seeded


def run(case: Case | str, regime: Regime | str, *, seed: int = DEFAULT_SEED) -> RunResult:
    """Train ``case`` for its steps under ``regime`` and return what it produced."""
    case = resolve_case(case)
    regime = parse_regime(regime)
    regime.validate(case)
    started = time.perf_counter()
    with seeded(seed), default_dtype(case.dtype):
        model = build_model(case)
        batches = load_batches(case)
        optimizer = case.optimizer(model.parameters())
        objective = Objective(case)
        with GradRecorder(model, optimizer) as recorder:
            losses = tuple(None if loss is None else float(loss)
                           for loss in regime.train(model, optimizer, batches, objective))
    return RunResult(
        case=case.name,
        regime=str(regime),
        losses=losses,
        grads=tuple(recorder.grads),
        weights=snapshot(model.named_parameters()),
        buffers=snapshot((n, b) for n, b in model.named_buffers() if b.is_floating_point()),
        seconds=time.perf_counter() - started,
    )


def build_model(case: Case) -> nn.Module:
    model = case.model()
    if not isinstance(model, nn.Module):
        raise InvalidArgument.type("model", model, "a factory returning a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidArgument(f"model of case {case.name!r} has no trainable parameters: expected at least one")
    return model.to(case.dtype).train()


def load_batches(case: Case) -> list[Batch]:
    """The case's data cut into ``steps`` global batches; wrong sizes are errors, never truncated."""
    data = case.data()
    if not (isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, Tensor) for t in data)):
        raise InvalidArgument.type("data", data, "a factory returning a tuple (inputs, targets) of tensors")
    inputs, targets = data
    if len(inputs) != len(targets):
        raise InvalidArgument(
            f"data of case {case.name!r}: inputs hold {len(inputs)} samples and targets {len(targets)}: "
            "expected the same number on dim 0"
        )
    if len(inputs) != case.samples:
        raise InvalidArgument(
            f"data of case {case.name!r} holds {len(inputs)} samples: expected exactly steps * batch_size = "
            f"{case.steps} * {case.batch_size} = {case.samples} (nothing is truncated or padded)"
        )
    if inputs.is_floating_point():
        inputs = inputs.to(case.dtype)
    if targets.is_floating_point():
        targets = targets.to(case.dtype)
    return [Batch(inputs[i : i + case.batch_size], targets[i : i + case.batch_size], case.items)
            for i in range(0, case.samples, case.batch_size)]


class GradRecorder:
    """Snapshot every parameter's gradient just before each ``optimizer.step``, whoever calls it."""

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        self._named = list(model.named_parameters())
        self._optimizer = optimizer
        self.grads: list[dict[str, Tensor]] = []

    def __enter__(self) -> GradRecorder:
        self._handle = self._optimizer.register_step_pre_hook(lambda *_: self.grads.append(self._snapshot()))
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _snapshot(self) -> dict[str, Tensor]:
        # A parameter that took no part in the step has no gradient: mathematically a zero one.
        return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in self._named}


def snapshot(named) -> dict[str, Tensor]:
    return {name: tensor.detach().clone() for name, tensor in named}
