"""A 6-10-3 MLP classifier, and the naive-scaling control on it: micro-batch mean / K with uneven chunks."""

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry


def model():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def data():
    return torch.randn(36, 6), torch.randint(0, 3, (36,))


mlp = ec.register_case(ec.Case(
    name="mlp",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=3,
    split=lambda m: (m[:2], m[2]),
    description="6-10-3 tanh MLP classifier, 12 samples per step, 3 steps",
))

naive_scaling_uneven_chunks = ec.register_case(dataclasses.replace(
    mlp,
    name="naive_scaling_uneven_chunks",
    regimes=("full_batch", "accumulate:chunks=5", "naive_accumulate:chunks=5"),
    expect_mismatch={"naive_accumulate": "12 samples in chunks of 3,3,2,2,2: mean / K over-weights the big chunks"},
    description="negative control: micro-batch mean / K with uneven chunks",
))

# The catalogue's entries that use these cases.
add_entry(Entry("naive scaling: micro-batch mean / K, uneven chunks", "naive_scaling_uneven_chunks",
                "naive_accumulate:chunks=5"))
