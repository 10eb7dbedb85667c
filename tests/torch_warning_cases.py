"""A case whose forward makes torch warn at every step, in every process that trains it (``F.softmax`` without
``dim``: torch/nn/functional.py's UserWarning); registered, so ``--cases-from`` and ranks find it by name."""

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

SOFTMAX_WARNING = "Implicit dimension choice for softmax has been deprecated"


class ImplicitSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc(x))  # torch warns: implicit dim


def _squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum(dim=1)


WARNS = ec.register_case(ec.Case(
    name="torch_warns_in_forward", model=ImplicitSoftmax, data=lambda: (torch.randn(8, 4), torch.randn(8, 3)),
    loss=_squared_error, batch_size=4, steps=2, dtype=torch.float64))
