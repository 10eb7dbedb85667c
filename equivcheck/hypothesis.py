"""Hypothesis strategies for fuzzing equivalence: batch sizes, chunkings, world sizes, regime specs
and whole small cases.

    from equivcheck.hypothesis import cases, regime_specs
    @given(case=cases(), data=st.data())
    def test_accumulation(case, data):
        spec = data.draw(regime_specs(case.batch_size, names=["accumulate"]))
        ec.check(case, [spec]).assert_equivalent()

Needs hypothesis (equivcheck's ``test`` extra); ``import equivcheck`` alone does not import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from .case import Case
from .precision import NAMES_OF_DTYPES, PRECISIONS
from .errors import InvalidArgument, expect_int
from .regimes import REGIMES, parse_regime

__all__ = ["ACTIVATIONS", "batch_sizes", "cases", "chunkings", "regime_specs", "world_sizes"]

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "sigmoid": nn.Sigmoid, "silu": nn.SiLU}


def batch_sizes(min_size: int = 1, max_size: int = 16) -> st.SearchStrategy[int]:
    """Global batch sizes (samples per optimizer step)."""
    expect_int("min_size", min_size)
    expect_int("max_size", max_size, minimum=min_size)
    return st.integers(min_size, max_size)


def chunkings(batch_size: int, *, uneven: bool = False) -> st.SearchStrategy[int]:
    """Chunk counts 1..batch_size; ``uneven``: only counts that cut the batch into unequal chunks."""
    expect_int("batch_size", batch_size)
    if not uneven:
        return st.integers(1, batch_size)
    counts = [k for k in range(2, batch_size + 1) if batch_size % k]
    if not counts:
        raise InvalidArgument.value("batch_size", batch_size, "a batch size with an uneven chunking (3 or more)")
    return st.sampled_from(counts)


def world_sizes(min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[int]:
    """Numbers of distributed ranks, min_size..max_size."""
    expect_int("min_size", min_size)
    expect_int("max_size", max_size, minimum=min_size)
    return st.integers(min_size, max_size)


def regime_specs(
    batch_size: int,
    names: Iterable[str] | None = None,
    *,
    pitfalls: bool = False,
    min_world_size: int = 1,
    max_world_size: int = 4,
) -> st.SearchStrategy[str]:
    """Specs such as ``accumulate:chunks=7`` or ``ddp_no_sync:world_size=3,chunks=2`` for a global batch
    of ``batch_size``.

    ``names``: the regimes to draw from (default: every registered one whose parameters can be drawn,
    pitfalls only if asked). Parameters are drawn by meaning: ``world_size`` from :func:`world_sizes`
    (at most the batch size), then ``chunks`` from :func:`chunkings` of the smallest shard a rank
    gets; parameters with a default keep it. A named regime with another required parameter is refused.
    """
    expect_int("batch_size", batch_size)
    expect_int("max_world_size", max_world_size, minimum=min_world_size)
    drawable = {"chunks", "world_size"}

    def required(name: str) -> list[str]:
        return [f.name for f in dataclasses.fields(REGIMES[name])
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    if names is None:
        chosen = [n for n, cls in REGIMES.items() if (pitfalls or not cls.pitfall) and set(required(n)) <= drawable]
    else:
        chosen = list(names)
        for name in chosen:
            if name not in REGIMES:
                raise InvalidArgument.unknown("regime", name, REGIMES)
            unknown = [f for f in required(name) if f not in drawable]
            if unknown:
                raise InvalidArgument(f"regime {name!r} needs {unknown[0]}=..., which regime_specs cannot draw: "
                                      f"it draws {', '.join(sorted(drawable))}")

    def spec_of(name: str) -> st.SearchStrategy[str]:
        fields = [f.name for f in dataclasses.fields(REGIMES[name]) if f.name in drawable]

        def with_world_size(world_size: int) -> st.SearchStrategy[str]:
            draws = {"world_size": st.just(world_size), "chunks": chunkings(batch_size // world_size)}
            values = st.fixed_dictionaries({f: draws[f] for f in fields})
            # Canonical specs (parameters left at their default are omitted), as equivcheck prints them.
            return values.map(lambda v: str(parse_regime(f"{name}:" + ",".join(f"{k}={v[k]}" for k in fields))))

        if "world_size" in fields:
            if min_world_size > batch_size:
                raise InvalidArgument.value("min_world_size", min_world_size,
                                            f"at most batch_size={batch_size} (every rank needs a sample)")
            return world_sizes(min_world_size, min(max_world_size, batch_size)).flatmap(with_world_size)
        return with_world_size(1)

    return st.one_of([spec_of(name) for name in chosen])


class _Classifier(nn.Sequential):
    """An MLP trunk (every layer but the last) under a linear head: split for detached_partial."""

    def split(self):
        return self[:-1], self[-1]


def _model(widths: Sequence[int], activation: str, batchnorm: bool) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (width_in, width_out) in enumerate(zip(widths[:-2], widths[1:-1])):
        layers.append(nn.Linear(width_in, width_out))
        if batchnorm and i == 0:
            layers.append(nn.BatchNorm1d(width_out))
        layers.append(ACTIVATIONS[activation]())
    layers.append(nn.Linear(widths[-2], widths[-1]))
    return _Classifier(*layers)


def _data(samples: int, width_in: int, classes: int, loss: str):
    inputs = torch.randn(samples, width_in)
    targets = torch.randint(0, classes, (samples,)) if loss == "cross_entropy" else torch.randn(samples, classes)
    return inputs, targets


def _squared_error(output, target):
    return ((output - target) ** 2).mean(dim=1)  # one loss per sample


@st.composite
def cases(
    draw,
    *,
    depths: st.SearchStrategy[int] = st.integers(0, 3),
    widths: st.SearchStrategy[int] = st.integers(1, 12),
    activations: st.SearchStrategy[str] = st.sampled_from(sorted(ACTIVATIONS)),
    dtypes: st.SearchStrategy[str] = st.sampled_from(sorted(NAMES_OF_DTYPES.values())),
    batch_sizes: st.SearchStrategy[int] = batch_sizes(),
    steps: st.SearchStrategy[int] = st.integers(1, 3),
    losses: st.SearchStrategy[str] = st.sampled_from(["cross_entropy", "squared_error"]),
    batchnorm: bool = False,
) -> Case:
    """Small MLP cases: ``depth`` hidden layers of drawn widths and activation, a dtype, a batch size,
    a number of steps and a loss. ``batchnorm`` puts a BatchNorm1d after the first hidden layer
    (depth >= 1): the accumulation pitfall, which such a case declares."""
    depth = draw(depths)
    if batchnorm:
        depth = max(depth, 1)
    shape = [draw(widths) for _ in range(depth + 1)] + [draw(st.integers(2, 5))]
    activation, dtype, batch, step_count, loss = (draw(activations), draw(dtypes), draw(batch_sizes), draw(steps),
                                                  draw(losses))
    name = f"drawn_{'x'.join(map(str, shape))}_{activation}_{dtype}_b{batch}_s{step_count}_{loss}"
    declared = {}
    if batchnorm:
        name += "_batchnorm"
        declared = {r: "BatchNorm normalises each micro-batch by its own statistics"
                    for r in ("accumulate", "sample_by_sample")}
    return Case(
        name=name,
        model=partial(_model, shape, activation, batchnorm),
        data=partial(_data, step_count * batch, shape[0], shape[-1], loss),
        loss=partial(F.cross_entropy, reduction="none") if loss == "cross_entropy" else _squared_error,
        batch_size=batch,
        steps=step_count,
        split=_Classifier.split,
        expect_mismatch=declared,
        dtype=PRECISIONS[dtype].dtype,
        description=f"drawn by equivcheck.hypothesis.cases: widths {shape}, {activation}, {dtype}",
    )
