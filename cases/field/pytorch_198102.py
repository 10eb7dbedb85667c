"""pytorch/pytorch#198102: compiled, an in-place op through a gapped unfold view zeroed the elements no window covers.

The report: when a tensor is mutated in place through an ``unfold`` view whose windows leave gaps (``step > size``),
the compiled program writes 0 into every element of the base that no window covers, where eager leaves them as they
were; its example, ``x.unfold(1, 1, 5).add_(...)`` on a 4 x 6 tensor, comes out ``[2, 0, 0, 0, 0, 12]`` compiled
against eager's ``[2, 2, 3, 4, 5, 12]`` in its first row, under ``aot_eager`` (functionalization regenerates the
base from the mutated view and fills the gaps with zeros), and other shapes of it (``view(24).unfold(0, 8, 24)``
with ``index_fill_``) too. It was open, with no fix named, when this row was written; the installed torch 2.13
reproduces it (measured: the report's example, and the step below). In training the zeros are activations: here the
team's model scales one feature of each group of 5 hidden units by 0.5 in place, through the report's view
(``hidden.unfold(1, 1, 5).mul_(0.5)`` on mlp's 10 hidden pre-activations, before the tanh), and its step compiles the
model with ``aot_eager``. Compiled, the 8 other hidden features are zeroed: the forward, the loss and every gradient
below them differ from eager's. The run as fixed takes the same columns through a strided slice,
``hidden[:, ::5].mul_(0.5)`` (measured equivalent on 2.13), the team's way round it; the reference is the step as
reported run eagerly.
"""

import weakref

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 198102, "compile",
          "compiled in-place op through a gapped unfold view (step > size): uncovered base elements zeroed",
          fixed_by="open; on torch 2.13, a strided slice view", fix_acts="compiler")

GROUP, SCALE = 5, 0.5


class GroupScaled(nn.Module):
    """mlp with the first hidden unit of each group of ``GROUP`` scaled in place before the activation."""

    def __init__(self, model, through_unfold):
        super().__init__()
        self.model, self.through_unfold = model, through_unfold

    def forward(self, inputs):
        hidden = self.model[0](inputs)
        if self.through_unfold:
            hidden.unfold(1, 1, GROUP).mul_(SCALE)
        else:
            hidden[:, ::GROUP].mul_(SCALE)
        return self.model[2](self.model[1](hidden))


RUNS = weakref.WeakKeyDictionary()  # each run's model, compiled or not, by its optimizer


def step_with(model, optimizer, batch, compiled=True, through_unfold=True):
    if optimizer not in RUNS:
        forward = GroupScaled(model, through_unfold)
        if compiled:
            torch._dynamo.reset()
            forward = torch.compile(forward, backend="aot_eager")
        RUNS[optimizer] = forward
    inputs, targets = batch
    loss = F.cross_entropy(RUNS[optimizer](inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    """As fixed on torch 2.13: the same columns through a strided slice."""
    return step_with(model, optimizer, batch, through_unfold=False)


def train_step_as_reported(model, optimizer, batch):
    return step_with(model, optimizer, batch)


def eager(model, optimizer, batch):
    """The reference: the step as reported, not compiled."""
    return step_with(model, optimizer, batch, compiled=False)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, eager)


def fixed():
    return ec.check_step("mlp", train_step, eager)
