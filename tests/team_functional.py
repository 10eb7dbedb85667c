"""A team's step that takes its gradients functionally (torch.func.grad over functional_call), as JAX-minded teams
write it: tests/test_compiled.py."""

import torch.nn.functional as F
from torch.func import functional_call, grad


def step(model, optimizer, batch):
    inputs, targets = batch

    def loss_of(parameters):
        return F.cross_entropy(functional_call(model, parameters, (inputs,)), targets)

    gradients = grad(loss_of)(dict(model.named_parameters()))
    optimizer.zero_grad()
    for name, parameter in model.named_parameters():
        parameter.grad = gradients[name].detach()
    optimizer.step()
    return None
