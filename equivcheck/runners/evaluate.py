"""Evaluating: a team's metric on a case's freshly built model, in this process: on one rank of a process
group (its sampler and its all-reduce decide what it sees), or alone on all the data (the reference).

:mod:`equivcheck.evaluation` compares the two; this module is what each side runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ..case import Case
from ..errors import InvalidArgument, NonFinite, exits_as_errors
from ..precision import resolve_precision
from ..regimes.user_code import epoch_dataset
from ..process.seeding import default_dtype, seeded
from .train import build_model, load_batches

EvaluateFn = Callable[[nn.Module, TensorDataset], "float | Mapping[str, float]"]
METRIC = "metric"  # the name of a metric given as one number


def evaluate(case: Case, fn: EvaluateFn, *, seed: int, device: torch.device | None = None) -> dict:
    """``fn(model, dataset)`` on the case's model built from ``seed`` (in eval mode, without gradients) and
    one epoch of its data; the metrics by name, and how many samples the data holds."""
    precision = resolve_precision(None, default=case.dtype)
    with seeded(seed), default_dtype(precision.dtype):
        model = build_model(case, precision, device).eval()
        batches = load_batches(case, precision, device)
    dataset = epoch_dataset(batches, case.epochs)
    with default_dtype(precision.dtype), torch.no_grad(), exits_as_errors():
        value = fn(model, dataset)
    return {"metrics": metrics_of(value), "samples": len(dataset)}


def metrics_of(value: object) -> dict[str, float]:
    """What ``evaluate`` returned as plain floats by name: one number is the metric ``'metric'``."""
    named = value if isinstance(value, Mapping) else {METRIC: value}
    metrics = {}
    for name, number in named.items():
        if isinstance(number, Tensor) and number.numel() == 1:
            number = number.item()
        if not isinstance(name, str) or isinstance(number, bool) or not isinstance(number, (int, float)):
            raise InvalidArgument.type("the value evaluate returned", value,
                                       "a number (a float or a one-element tensor) or a dict of str -> number")
        if not math.isfinite(number):
            raise NonFinite(f"evaluate returned a non-finite metric {name!r}: {number}")
        metrics[name] = float(number)
    return metrics
