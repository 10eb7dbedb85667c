"""Regimes: the ways of computing one optimizer step on one global batch.

Each regime is a frozen dataclass parsed from a short spec (``accumulate:chunks=4``). Its
``train_step`` performs exactly one optimizer step on the global batch the way a training loop
would, and returns the batch loss. Faithful regimes normalise by the item count of the *global*
batch, so they reproduce ``full_batch`` up to rounding; pitfall regimes reproduce a known bug,
and equivcheck must report them as mismatches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .case import Batch, Case, Objective
from .errors import InvalidArgument, expect_int


@dataclasses.dataclass(frozen=True)
class Regime:
    name: ClassVar[str]
    summary: ClassVar[str]
    pitfall: ClassVar[bool] = False
    # Where PyTorch itself refuses the regime in general (it crashes), why: kept to show the crash, and
    # never drawn by equivcheck.hypothesis as a regime that must stay equivalent.
    trap: ClassVar[str] = ""
    distributed: ClassVar[bool] = False  # runs on every rank of a process group (see equivcheck.distributed)
    syncs_per_step: ClassVar[int | None] = None  # gradient all-reduce rounds a faithful step makes

    def __str__(self) -> str:
        """The canonical spec: parameters in declaration order, those left at their default omitted."""
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                          if getattr(self, f.name) != f.default)
        return f"{self.name}:{params}" if params else self.name

    def validate(self, case: Case) -> None:
        """Raise :class:`InvalidArgument` if this regime cannot run ``case``."""

    def unavailable(self) -> str | None:
        """Why this machine cannot run the regime (missing GPUs), or None: the check is skipped, not faked."""
        return None

    def device(self) -> torch.device:
        """Where this process trains: the CPU, or its own GPU under nccl or DataParallel."""
        return torch.device("cpu")

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module ``train_step`` drives: the model itself, or a DDP / DataParallel wrapper around it."""
        return model

    def train_step(self, model: nn.Module, optimizer: Optimizer, batch: Batch, objective: Objective) -> Tensor:
        raise NotImplementedError

    def train(
        self, model: nn.Module, optimizer: Optimizer, batches: Sequence[Batch], objective: Objective
    ) -> Sequence[Tensor | float | None]:
        """Train on every global batch in turn; the batch losses (None: not reported). A whole-loop
        regime (a team's own training loop) overrides this instead of ``train_step``."""
        return [self.train_step(model, optimizer, batch, objective) for batch in batches]


def finish_step(optimizer: Optimizer, objective: Objective | None = None) -> None:
    """One optimizer step (through the objective's GradScaler if given), then clear the gradients."""
    if objective is None:
        optimizer.step()
    else:
        objective.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def chunk_pairs(batch: Batch, chunks: int) -> list[tuple[Tensor, Tensor]]:
    """``chunks`` (inputs, targets) micro-batches of near-equal size (12 samples in 5: 3, 3, 2, 2, 2)."""
    return list(zip(batch.inputs.tensor_split(chunks), batch.targets.tensor_split(chunks)))


def backward_chunks(
    forward: Callable[[Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    chunks: int,
    part_loss: Callable[[Tensor, Tensor], Tensor],
    *,
    retain_graph: bool = False,
    objective: Objective | None = None,
) -> Tensor:
    """Back-propagate ``part_loss(forward(x), y)`` for each of ``chunks`` slices; return their sum.

    With ``objective``, each backward goes through its GradScaler (a no-op unless the precision uses one).
    """
    total = 0.0
    for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
        part = part_loss(forward(x), y)
        if objective is None:
            part.backward(retain_graph=retain_graph)
        else:
            objective.backward(part, retain_graph=retain_graph)
        total = total + part.detach()
    return total


def global_mean_part(objective: Objective, batch: Batch) -> Callable[[Tensor, Tensor], Tensor]:
    """A chunk's share of the global mean: its loss sum over the item count of the whole batch."""
    return lambda output, targets: objective.sum(output, targets) / batch.items


@dataclasses.dataclass(frozen=True)
class FullBatch(Regime):
    name = "full_batch"
    summary = "one forward and one backward on the global batch (the reference)"

    def train_step(self, model, optimizer, batch, objective):
        loss = objective.sum(model(batch.inputs), batch.targets) / batch.items
        objective.backward(loss)
        finish_step(optimizer, objective)
        return loss.detach()


@dataclasses.dataclass(frozen=True)
class SampleBySample(Regime):
    name = "sample_by_sample"
    summary = "one forward and backward per sample, each weighted by 1/items of the global batch"

    def train_step(self, model, optimizer, batch, objective):
        loss = backward_chunks(model, batch.inputs, batch.targets, len(batch), global_mean_part(objective, batch),
                               objective=objective)
        finish_step(optimizer, objective)
        return loss


@dataclasses.dataclass(frozen=True)
class Chunked(Regime):
    """A regime that cuts the global batch into ``chunks`` micro-batches (possibly uneven)."""

    chunks: int

    def __post_init__(self) -> None:
        expect_int("chunks", self.chunks)

    def validate(self, case: Case) -> None:
        if self.chunks > case.batch_size:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: chunks={self.chunks} is not allowed: expected an "
                f"integer from 1 to {case.batch_size} (the case's batch_size)"
            )


@dataclasses.dataclass(frozen=True)
class Accumulate(Chunked):
    name = "accumulate"
    summary = "K micro-batches, each loss sum / global item count, one optimizer step"

    def train_step(self, model, optimizer, batch, objective):
        loss = backward_chunks(model, batch.inputs, batch.targets, self.chunks, global_mean_part(objective, batch),
                               objective=objective)
        finish_step(optimizer, objective)
        return loss


@dataclasses.dataclass(frozen=True)
class RetainedGraph(Chunked):
    name = "retained_graph"
    summary = "forward once, backward(retain_graph=True) per loss part: same gradients, no memory saved"

    def train_step(self, model, optimizer, batch, objective):
        output = model(batch.inputs)
        total = backward_chunks(lambda out: out, output, batch.targets, self.chunks,
                                global_mean_part(objective, batch), retain_graph=True,
                                objective=objective)
        finish_step(optimizer, objective)
        return total


@dataclasses.dataclass(frozen=True)
class DetachedPartial(Chunked):
    name = "detached_partial"
    summary = "trunk forward once, head accumulated per chunk on its detached output, trunk backward once"

    def validate(self, case: Case) -> None:
        super().validate(case)
        if case.split is None:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: split=None is not allowed: expected a function "
                "model -> (trunk, head) with head(trunk(x)) == model(x)"
            )

    def train_step(self, model, optimizer, batch, objective):
        trunk, head = objective.split(model)
        features = trunk(batch.inputs)
        detached = features.detach().requires_grad_()
        total = backward_chunks(head, detached, batch.targets, self.chunks, global_mean_part(objective, batch),
                                objective=objective)
        if features.requires_grad:  # a trunk with nothing to train (identity, frozen) has no graph to back-propagate
            features.backward(detached.grad)  # already scaled: the head's backward went through the scaler
        finish_step(optimizer, objective)
        return total


@dataclasses.dataclass(frozen=True)
class NaiveAccumulate(Chunked):
    name = "naive_accumulate"
    summary = "PITFALL: micro-batch mean / K; wrong whenever chunks or their item counts are uneven"
    pitfall = True

    def train_step(self, model, optimizer, batch, objective):
        total = backward_chunks(model, batch.inputs, batch.targets, self.chunks,
                                lambda output, targets: objective.mean(output, targets) / self.chunks,
                                objective=objective)
        finish_step(optimizer, objective)
        return total


REGIMES: dict[str, type[Regime]] = {}


def register_regime(cls: type[Regime]) -> type[Regime]:
    """Make a regime class reachable by its spec name; a class decorator."""
    if cls.name in REGIMES and REGIMES[cls.name] is not cls:
        raise InvalidArgument.value("name", cls.name, "a regime name not registered yet")
    REGIMES[cls.name] = cls
    return cls


for _cls in (FullBatch, SampleBySample, Accumulate, RetainedGraph, DetachedPartial, NaiveAccumulate):
    register_regime(_cls)
DEFAULT_REGIMES = (
    "full_batch",
    "sample_by_sample",
    "accumulate:chunks=5",
    "retained_graph:chunks=5",
    "detached_partial:chunks=5",
    "ddp:world_size=2",
    "ddp_no_sync:world_size=2,chunks=3",
    "data_parallel",
)

_FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def parse_regime(spec: str | Regime) -> Regime:
    """``'accumulate:chunks=4'`` -> ``Accumulate(chunks=4)``; a Regime passes through."""
    if isinstance(spec, Regime):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgument.type("regime", spec, "a regime spec str such as 'accumulate:chunks=4'")
    name, _, params_text = spec.strip().partition(":")
    if name not in REGIMES:
        raise InvalidArgument.unknown("regime", name, REGIMES)
    cls = REGIMES[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, object] = {}
    for item in filter(None, params_text.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if key not in fields or not eq:
            allowed = ", ".join(f"{k}=..." for k in fields) or "no parameters"
            raise InvalidArgument(f"regime spec {spec!r}: {item!r} is not allowed: {name} takes {allowed}")
        if key in kwargs:
            raise InvalidArgument(f"regime spec {spec!r}: {key} is given twice: expected each parameter once")
        kwargs[key] = _convert(key, raw.strip(), _FIELD_TYPES[str(fields[key].type)])
    missing = [k for k, f in fields.items() if k not in kwargs and f.default is dataclasses.MISSING]
    if missing:
        example = ",".join(f"{k}=2" for k in missing)
        raise InvalidArgument(f"regime spec {spec!r}: {name} needs {', '.join(missing)} (e.g. '{name}:{example}')")
    return cls(**kwargs)


def _convert(key: str, raw: str, kind: type) -> object:
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise InvalidArgument.type(key, raw, kind.__name__) from None
    if kind is bool:
        if raw not in ("0", "1", "true", "false"):
            raise InvalidArgument.value(key, raw, "one of 0, 1, true, false")
        return raw in ("1", "true")
    return raw
