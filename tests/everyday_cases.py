"""Cases a team writes every day, registered for the ranks to import: an optimizer that clips through a step
pre-hook, a trunk frozen for fine-tuning, a sparse embedding."""

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

MAX_NORM = 0.05  # below the MLP's gradient norm at every step: the hook's clipping engages


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def data():
    return torch.randn(36, 6), torch.randint(0, 3, (36,))


def sgd_clipping_in_a_hook(parameters):
    """The team's habit: clipping (or warmup, or an EMA) registered on the optimizer, run before every step."""
    optimizer = torch.optim.SGD(parameters, lr=0.5)

    def clip(opt, args, kwargs):
        torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], MAX_NORM)

    optimizer.register_step_pre_hook(clip)
    return optimizer


def frozen_trunk() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    model[0].requires_grad_(False)  # fine-tuning the head alone
    return model


def sparse_embedding() -> nn.Module:
    return nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))


def token_data():
    return torch.randint(0, 20, (36, 3)), torch.randint(0, 3, (36,))


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.5)


def trainable_sgd(parameters):
    return torch.optim.SGD([p for p in parameters if p.requires_grad], lr=0.5)


CLIPPED_BY_HOOK = ec.register_case(ec.Case(
    name="clipped_by_hook", model=mlp, data=data, loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    optimizer=sgd_clipping_in_a_hook, batch_size=12, steps=3,
    description="an MLP whose optimizer clips to 0.05 in a step pre-hook"))
FROZEN_TRUNK = ec.register_case(ec.Case(
    name="frozen_trunk", model=frozen_trunk, data=data, loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    optimizer=trainable_sgd, batch_size=12, steps=3, description="an MLP whose first Linear is frozen"))
SPARSE_EMBEDDING = ec.register_case(ec.Case(
    name="sparse_embedding", model=sparse_embedding, data=token_data,
    loss=lambda out, y: F.cross_entropy(out, y, reduction="none"), optimizer=sgd, batch_size=12, steps=3,
    description="a sparse nn.Embedding (sparse gradients) under SGD"))


class AdamWOfTheTeams(torch.optim.AdamW):
    """A team's AdamW whose ``step`` hands over to its parent's: torch runs its step hooks twice a step once any AdamW
    was made in the process (each class's ``step`` is wrapped when an instance of it is made)."""

    def step(self, closure=None):
        return super().step(closure)


def teams_adamw(parameters):
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # an AdamW made first, as any other check in the process makes one
    return AdamWOfTheTeams(parameters, lr=1e-2)


def decaying(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


SUBCLASSED_ADAMW = ec.register_case(ec.Case(
    name="subclassed_adamw", model=mlp, data=data, loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    optimizer=teams_adamw, scheduler=decaying, batch_size=12, steps=3,
    description="an MLP under an AdamW subclass whose step calls super().step(), its learning rate halved each step"))
