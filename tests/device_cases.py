"""A case that says which process trained it: where ``EQUIVCHECK_TEST_TRAINED_IN`` names a file, every build of its
model appends the building process's pid and its parent's (tests/test_device.py reads them)."""

import os

import torch
from torch import nn

import equivcheck as ec

RECORD_VARIABLE = "EQUIVCHECK_TEST_TRAINED_IN"


def recorded_model() -> nn.Module:
    record = os.environ.get(RECORD_VARIABLE)
    if record:
        with open(record, "a") as file:
            file.write(f"{os.getpid()} {os.getppid()}\n")
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


CASE_NAME = "trained_where"


def mean_step(model, optimizer, batch):
    """A team's faithful step: the mean loss of the batch it is handed (DDP averages it over the ranks)."""
    inputs, targets = batch
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


ec.register_case(ec.Case(
    name=CASE_NAME, model=recorded_model,
    data=lambda: (torch.randn(12, 4), torch.randn(12, 2)),
    loss=lambda out, target: ((out - target) ** 2).sum(dim=1), batch_size=6, steps=2,
))
