"""pytorch/pytorch#91468: a hook registered on an intermediate that a compiled graph computed never saw its gradient.

The issue (open, "torch.compile incorrect when imperative autograd APIs are used") gives two examples of silent
incorrectness. In the second, a compiled function computes ``y = x * x`` and ``z`` from ``y``, breaks the graph
(a ``print``), registers ``y.register_hook(lambda g: 3.14 * g)`` and takes ``torch.autograd.grad(z, x)``: eager runs
the hook on the gradient flowing from ``z`` into ``y``; compiled, ``y`` is an output of the first graph, whose
backward carries ``z``'s gradient to ``x`` inside the graph, so the hook on the output is handed no gradient (None)
and the result is as if it had never been registered (measured on the installed torch 2.13: 5 where eager gives
9.28). (Its first example, ``retain_grad`` on intermediates, now works on 2.13.) A training step meets it whenever it
hooks a tensor the compiled model returned beside its output: here the team compiles mlp (``aot_eager``) as a module
that returns the logits and the trunk's features, and the step scales the gradient reaching the trunk by 0.5 with
``features.register_hook``, a gradient multiplier on the shared trunk. Compiled, the trunk's gradient comes out
unscaled. The run as fixed registers the hook inside the model's forward, where Dynamo traces it into the graph's
backward (measured equivalent on 2.13), the team's way round it; the reference is the same step run eagerly.
"""

import weakref

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 91468, "compile",
          "hook on an intermediate a compiled graph computed (y before a graph break): handed None, no effect",
          fixed_by="open; on torch 2.13, the hook registered in the compiled forward", fix_acts="compiler")

TRUNK_GRADIENT_SCALE = 0.5


def scale_trunk_gradient(grad):
    return None if grad is None else grad * TRUNK_GRADIENT_SCALE


class WithFeatures(nn.Module):
    """The team's model: mlp's classifier logits and its trunk's features (the first two layers' output)."""

    def __init__(self, model, hooks_in_forward):
        super().__init__()
        self.model, self.hooks_in_forward = model, hooks_in_forward

    def forward(self, inputs):
        features = self.model[1](self.model[0](inputs))
        if self.hooks_in_forward:
            features.register_hook(scale_trunk_gradient)
        return self.model[2](features), features


RUNS = weakref.WeakKeyDictionary()  # each run's model with its features, compiled or not, by its optimizer


def step_with(model, optimizer, batch, compiled=True, hooks_in_forward=False):
    if optimizer not in RUNS:
        forward = WithFeatures(model, hooks_in_forward)
        if compiled:
            torch._dynamo.reset()
            forward = torch.compile(forward, backend="aot_eager")
        RUNS[optimizer] = forward
    inputs, targets = batch
    logits, features = RUNS[optimizer](inputs)
    if not hooks_in_forward:
        features.register_hook(scale_trunk_gradient)
    loss = F.cross_entropy(logits, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    """As fixed on torch 2.13: the hook registered in the forward the compiler traces."""
    return step_with(model, optimizer, batch, hooks_in_forward=True)


def train_step_as_reported(model, optimizer, batch):
    """The hook registered by the step on the features the compiled model returned."""
    return step_with(model, optimizer, batch)


def eager(model, optimizer, batch):
    """The reference: the step as reported, not compiled (eager runs the hook either way)."""
    return step_with(model, optimizer, batch, compiled=False)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, eager)


def fixed():
    return ec.check_step("mlp", train_step, eager)
