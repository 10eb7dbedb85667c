"""The mlp case of equivcheck (cases/mlp.py) declared for the peer trainparity: its first optimizer update.

Imported by the peer's worker processes from its own virtual environment (bench/.peer-venv): torch only,
no equivcheck. Same model, optimizer, dtype and 12-sample batch; trainparity checks one update per call.
"""

import torch
import torch.nn.functional as F
from torch import nn
from trainparity.api import LossAccounting, TrainingState


class MlpCase:
    equivalence = "12 samples, one update: full batch vs micro-batches; per-sample cross-entropy, global mean"

    def build(self, seed: int, device: str) -> TrainingState:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).to(device, torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return TrainingState(model, optimizer)

    def batch(self, device: str) -> object:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(12, 6, generator=generator, dtype=torch.float64)
        return inputs.to(device), torch.randint(0, 3, (12,), generator=generator).to(device)

    def loss(self, state: TrainingState, batch: object) -> LossAccounting:
        inputs, targets = batch
        losses = F.cross_entropy(state.model(inputs), targets, reduction="none")
        return LossAccounting(losses.mean(), losses.sum(), int(losses.numel()))
