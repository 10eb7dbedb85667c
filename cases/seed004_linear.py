"""Seed 004: one weight, two samples, MSE. Full batch and sample by sample both give grad -20, weight 1.2."""

import torch
from torch import nn

import equivcheck as ec


class ExampleLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0]))

    def forward(self, x):
        return self.weight * x


def data():
    x = torch.tensor([4.0, 2.0])
    return x, 2 * x


seed004_linear = ec.register_case(ec.Case(
    name="seed004_linear",
    model=ExampleLinear,
    data=data,
    loss=lambda output, target: (target - output) ** 2,
    batch_size=2,
    steps=1,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
    regimes=("full_batch", "sample_by_sample", "accumulate:chunks=2", "retained_graph:chunks=2"),
    description="seed 004's ExampleLinear: gradient -20 and weight 1.2 whichever way the mean is taken",
))
