"""pytorch/pytorch#193279: under torch.compile, torch.func.grad dropped an autograd.Function's custom backward.

The report: when ``torch.func.grad`` is applied to a ``torch.autograd.Function`` inside a ``torch.compile``d function,
Dynamo inlines the Function's ``forward()`` as plain code and silently discards its custom ``backward``; functorch's
grad interpreter then differentiates the inlined operations by their default rules, so the compiled function returns
another gradient than eager, with no error, warning or graph break, even under ``fullgraph=True`` (its example: a
``sin`` whose custom backward returns zeros comes out with ``cos``). It is the reverse-mode twin of #192985 (the
custom ``jvp`` dropped under ``torch.func.jvp``). The installed torch 2.13 reproduces it (measured) where the Function
is applied to a tensor being differentiated, which is what quantization-aware training does: here the team's first
layer fake-quantizes its weight with a straight-through estimator (forward rounds to 1/8, backward passes the
gradient through), and its step computes the gradients functionally, ``torch.func.grad_and_value`` of the loss over
the parameters (``functional_call``), compiled. Compiled, the rounding's own derivative (zero) replaced the
straight-through one, so the quantized layer's weight got a zero gradient and never trained (measured). The run as
fixed keeps ``torch.func.grad_and_value`` outside the compiled region and compiles the loss, the team's way round it
on 2.13 (measured equivalent); the reference is eager full batch, where autograd runs the custom backward. The checks
pass ``measure_memory=False``: equivcheck's activation meter is a saved-tensor hook, which ``torch.func.grad``
refuses. Measured on the other torches here: 2.11 reproduces it too; 2.15.0 trains the code as reported right (both
checks equivalent), so the row expects the bug before 2.15.
"""

import dataclasses
import weakref

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 193279, "compile",
          "torch.compile(torch.func.grad(...)) inlined an autograd.Function's forward, dropped its backward",
          fixed_by="on torch 2.13, torch.func.grad outside the compiled region", torch_before="2.15",
          fix_acts="compiler")


class RoundSTE(torch.autograd.Function):
    """Fake quantization to steps of 1/8 with a straight-through gradient (functorch-style: ``setup_context``)."""

    @staticmethod
    def forward(weight):
        return torch.round(weight * 8) / 8

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        return grad


class QuantizedLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, RoundSTE.apply(self.weight), self.bias)


QAT = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_pytorch_qat",
    model=lambda: nn.Sequential(QuantizedLinear(6, 10), nn.Tanh(), nn.Linear(10, 3)),
    description="mlp whose first layer fake-quantizes its weight with a straight-through estimator"))

GRADIENTS = weakref.WeakKeyDictionary()  # each run's compiled gradient function, by its optimizer


def step_with(model, optimizer, batch, compiles_the_transform=False):
    if optimizer not in GRADIENTS:
        torch._dynamo.reset()

        def loss_of(parameters, inputs, targets):
            return F.cross_entropy(functional_call(model, parameters, (inputs,)), targets)

        if compiles_the_transform:
            GRADIENTS[optimizer] = torch.compile(grad_and_value(loss_of), backend="aot_eager")
        else:
            GRADIENTS[optimizer] = grad_and_value(torch.compile(loss_of, backend="aot_eager"))
    parameters = {name: p.detach() for name, p in model.named_parameters()}
    grads, loss = GRADIENTS[optimizer](parameters, *batch)
    for name, p in model.named_parameters():
        p.grad = grads[name]
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    """As fixed on torch 2.13: the loss compiled, its gradient taken outside the compiled region."""
    return step_with(model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    """The gradient transform compiled with the loss."""
    return step_with(model, optimizer, batch, compiles_the_transform=True)


def buggy():
    return ec.check_step(QAT, train_step_as_reported, measure_memory=False)


def fixed():
    return ec.check_step(QAT, train_step, measure_memory=False)
