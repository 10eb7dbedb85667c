"""The in-process runner: train a case under one regime from the seeded start, record everything."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .case import Batch, Case, Objective
from .communication import CommCounter
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
    device = regime.device()
    with seeded(seed), default_dtype(case.dtype):
        model = build_model(case).to(device)
        batches = load_batches(case, device)
        optimizer = case.optimizer(model.parameters())
        objective = Objective(case)
        module = regime.wrap(model)
        counter = CommCounter.attach(module) if isinstance(module, DistributedDataParallel) else None
        with GradRecorder(model, optimizer, counter) as recorder:
            losses = tuple(None if loss is None else float(loss)
                           for loss in regime.train(module, optimizer, batches, objective))
    return RunResult(
        case=case.name,
        regime=str(regime),
        losses=losses,
        grads=tuple(recorder.grads),
        weights=snapshot(model.named_parameters()),
        buffers=snapshot((n, b) for n, b in model.named_buffers() if b.is_floating_point()),
        seconds=time.perf_counter() - started,
        syncs=None if counter is None else tuple(recorder.syncs),
        sync_bytes=None if counter is None else tuple(recorder.sync_bytes),
    )


def build_model(case: Case) -> nn.Module:
    model = case.model()
    if not isinstance(model, nn.Module):
        raise InvalidArgument.type("model", model, "a factory returning a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidArgument(f"model of case {case.name!r} has no trainable parameters: expected at least one")
    return model.to(case.dtype).train()


def load_batches(case: Case, device: torch.device = torch.device("cpu")) -> list[Batch]:
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
    inputs = inputs.to(device, case.dtype if inputs.is_floating_point() else None)
    targets = targets.to(device, case.dtype if targets.is_floating_point() else None)
    return [Batch(inputs[i : i + case.batch_size], targets[i : i + case.batch_size], case.items)
            for i in range(0, case.samples, case.batch_size)]


class GradRecorder:
    """Snapshot every parameter's gradient just before each ``optimizer.step``, whoever calls it,
    and, under DDP, what was communicated since the previous step."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, counter: CommCounter | None = None) -> None:
        self._named = list(model.named_parameters())
        self._optimizer = optimizer
        self._counter = counter
        self.grads: list[dict[str, Tensor]] = []
        self.syncs: list[int] = []
        self.sync_bytes: list[int] = []

    def __enter__(self) -> GradRecorder:
        self._handle = self._optimizer.register_step_pre_hook(lambda *_: self._record())
        return self

    def _record(self) -> None:
        self.grads.append(self._snapshot())
        if self._counter is not None:
            syncs, sent = self._counter.take()
            self.syncs.append(syncs)
            self.sync_bytes.append(sent)

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _snapshot(self) -> dict[str, Tensor]:
        # A parameter that took no part in the step has no gradient: mathematically a zero one.
        return {n: _cpu_copy(p.grad) if p.grad is not None else torch.zeros_like(p, device="cpu")
                for n, p in self._named}


def snapshot(named) -> dict[str, Tensor]:
    return {name: _cpu_copy(tensor) for name, tensor in named}


def _cpu_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)
