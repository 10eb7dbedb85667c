"""Evaluating: a team's metric on a case's freshly built model, in this process: on one rank of a process
group (its sampler and its all-reduce decide what it sees), or alone on all the data (the reference).

:mod:`equivcheck.evaluation` compares the two; this module is what each side runs. A failed check's second
evaluation records on each side what its model was called on, read back to the dataset's samples
(:class:`SamplesSeen`): how many times each sample was evaluated and what the model output for it, so that a metric
that parts can be said to part in the model's outputs or after them (:mod:`equivcheck.judge.eval_location`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.data import TensorDataset

from ..arrays import to_array
from ..case import Case
from ..errors import InvalidArgument, NonFinite, exits_as_errors
from ..judge.eval_location import digests
from ..precision import resolve_precision
from ..regimes.user_code import epoch_dataset
from ..process import progress
from ..process.seeding import default_dtype, seeded
from .train import build_model, load_batches

EvaluateFn = Callable[[nn.Module, TensorDataset], "float | Mapping[str, float]"]
METRIC = "metric"  # the name of a metric given as one number


def evaluate(case: Case, fn: EvaluateFn, *, seed: int, device: torch.device | None = None,
             records: bool = False) -> dict:
    """``fn(model, dataset)`` on the case's model built from ``seed`` (in eval mode, without gradients) and
    one epoch of its data; the metrics by name, and how many samples the data holds; where it ``records``, the
    samples its model's calls were fed too (a failed check's second evaluation: an equivalent one records nothing)."""
    precision = resolve_precision(None, default=case.dtype)
    with seeded(seed), default_dtype(precision.dtype):
        model = build_model(case, precision, device).eval()
        batches = load_batches(case, precision, device)
    dataset = epoch_dataset(batches, case.epochs)
    with default_dtype(precision.dtype), torch.no_grad(), exits_as_errors(), calls_as_progress(model), \
            samples_seen(model, dataset, records) as seen:
        value = fn(model, dataset)
    evaluated = {"metrics": metrics_of(value), "samples": len(dataset)}
    return evaluated | ({"seen": seen.result()} if records else {})


# The output elements a side keeps whole (float64: 32 MiB); beyond, every sample's output is kept as its digest.
KEPT_WHOLE = 1 << 22


class SamplesSeen:
    """The dataset's samples the model's calls were fed, read back from their input rows: each sample's count and its
    output row as first computed, or why the calls do not read back to samples (the team's code transformed them, or
    the model's output is not one row per sample). Identical samples count as the first of them.

    Output rows are kept whole up to :data:`KEPT_WHOLE` elements in all; beyond, each is kept as its digest,
    so that a sample costs three numbers however large its output (an LM's logits)."""

    def __init__(self, dataset: TensorDataset) -> None:
        inputs = dataset.tensors[0].detach().cpu()
        self._shape, self._dtype = inputs.shape[1:], inputs.dtype
        self._index: dict[bytes, int] = {}
        for index, key in enumerate(_keys(inputs)):
            self._index.setdefault(key, index)
        self.counts = [0] * len(inputs)
        self.outputs: list[Tensor | tuple | None] = [None] * len(inputs)  # rows whole, or digests once ``digested``
        self.digested, self._kept = False, 0
        self.unread = ""

    def called(self, args: tuple, kwargs: dict, output: object) -> None:
        """A call of the model, read back; one that cannot be leaves the evaluation unlocated, never failed."""
        if self.unread:
            return
        try:
            self._read(args, kwargs, output)
        except Exception as error:  # noqa: BLE001 - a record the team's evaluation must not die of
            self.unread = f"the model's calls could not be read back to samples ({type(error).__name__}: {error})"

    def _read(self, args: tuple, kwargs: dict, output: object) -> None:
        fed = next((leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)), None)
        if fed is None or fed.shape[1:] != self._shape or fed.dtype != self._dtype:
            self.unread = "the model was called on other tensors than the dataset's samples (another shape or dtype)"
            return
        rows = next((leaf for leaf in tree_leaves(output) if isinstance(leaf, Tensor) and leaf.ndim
                     and len(leaf) == len(fed)), None)
        if rows is None:
            self.unread = "the model's output holds no tensor of one row per sample it was fed"
            return
        indices = [self._index.get(key) for key in _keys(fed.detach().cpu())]
        if None in indices:
            self.unread = "the model was fed a row the dataset does not hold (the team's code changed its samples)"
            return
        first = {}  # each sample seen for the first time, at its first row here
        for position, index in enumerate(indices):
            self.counts[index] += 1
            if self.outputs[index] is None and index not in first:
                first[index] = position
        if first:
            self._keep(list(first), rows.detach()[list(first.values())].reshape(len(first), -1).double())

    def _keep(self, indices: list[int], rows: Tensor) -> None:
        if not self.digested and self._kept + rows.numel() > KEPT_WHOLE:
            self.digested = True
            by_size: dict[int, list[int]] = {}  # the rows kept whole so far, digested a size at a time
            for index, kept in enumerate(self.outputs):
                if kept is not None:
                    by_size.setdefault(kept.numel(), []).append(index)
            for kept in by_size.values():
                for index, out in zip(kept, digests(torch.stack([self.outputs[i] for i in kept]))):
                    self.outputs[index] = out
        self._kept += rows.numel()
        kept = digests(rows) if self.digested else rows.cpu()
        for index, out in zip(indices, kept):
            self.outputs[index] = out

    def result(self) -> dict:
        """As plain values (numpy arrays, numbers: a rank's reply crosses processes pickled)."""
        if self.unread or not any(self.counts):
            return {"unread": self.unread or "the model was never called on a sample"}
        if self.digested:
            return {"counts": self.counts, "digests": self.outputs}
        return {"counts": self.counts, "outputs": [None if out is None else to_array(out) for out in self.outputs]}


def _keys(rows: Tensor) -> list[bytes]:
    """Samples' rows as bytes: equal rows, and only they, share a key (in any dtype)."""
    flat = rows.contiguous().reshape(len(rows), -1).view(torch.uint8).numpy()
    return [row.tobytes() for row in flat]


@contextlib.contextmanager
def calls_as_progress(model: nn.Module) -> Iterator[None]:
    """Each call of ``model`` is progress (progress.py): an evaluation takes no optimizer step to show it by, and one
    longer than its timeout that keeps calling its model is no hang."""
    hook = model.register_forward_hook(lambda *_: progress.note())
    try:
        yield
    finally:
        hook.remove()


@contextlib.contextmanager
def samples_seen(model: nn.Module, dataset: TensorDataset, records: bool = True) -> Iterator[SamplesSeen | None]:
    """While evaluating: every call of ``model`` read back to the samples it was fed (where it ``records``)."""
    if not records:
        yield None
        return
    seen = SamplesSeen(dataset)
    hook = model.register_forward_hook(lambda _, args, kwargs, output: seen.called(args, kwargs, output),
                                       with_kwargs=True)
    try:
        yield seen
    finally:
        hook.remove()


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
