"""A small CNN classifier on 6x6 single-channel images."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec


def model():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5)
    )


def data():
    return torch.randn(24, 1, 6, 6), torch.randint(0, 5, (24,))


cnn = ec.register_case(ec.Case(
    name="cnn",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=2,
    split=lambda m: (m[:5], m[5]),
    description="two conv layers and a linear classifier",
))
