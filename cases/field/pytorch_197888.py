"""pytorch/pytorch#197888: compiled channels_last_3d adaptive_max_pool3d scattered its gradient to wrong positions.

The report: for ``F.adaptive_max_pool3d`` on a ``channels_last_3d`` input, eager and ``aot_eager`` compute the same
input gradient and Inductor another (max difference 282 in its example, torch 2.14 and nightly); the forward values
and indices are identical, but the backward scatters the gradient to the wrong places. The CPU kernels of
``adaptive_max_pool3d_backward`` (and ``fractional_max_pool{2,3}d_backward``) make ``grad_output`` contiguous but
read ``indices`` through its raw data pointer, so non-contiguous indices are read as if contiguous: eager autograd
never passes such indices, Inductor does once it lays the saved indices out in the input's memory format. So a model
that follows the channels-last recommendation and is compiled trains on silently wrong gradients. The issue was
open, with no fix named, when this row was written; the installed torch 2.13 reproduces it on CPU (measured: the
report's example, and a model like this row's with parameter gradients off by 0.17). Here the team's model scales
each channel of a 3-D volume by a learned factor, pools it with ``adaptive_max_pool3d`` and classifies the pooled
features; its step puts the model and the batch in ``channels_last_3d`` and compiles with Inductor. (Measured on
2.13: the same pool after a ``Conv3d`` came out exact, so the row's model is the one that reproduces.) The run as
fixed keeps the default contiguous format, the team's way round it on 2.13 (measured equivalent). Measured on torch
2.11 and 2.15.0 on CPU: the code as reported trains right there (both checks equivalent), so the row expects the
bug from 2.13 (the report names 2.14 and a nightly too) to before 2.15.
"""

import weakref

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 197888, "compile",
          "inductor, channels_last_3d: adaptive_max_pool3d_backward read non-contiguous indices as contiguous",
          fixed_by="open; on torch 2.13, the contiguous memory format", torch_from="2.13", torch_before="2.15",
          fix_acts="compiler")

CHANNELS, VOLUME, POOLED = 4, (4, 6, 10), (2, 3, 5)


class ScaledPool(nn.Module):
    """A learned scale per channel of the volume, an adaptive max pool, a linear classifier of the pooled features."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(1, CHANNELS, 1, 1, 1))
        self.head = nn.Linear(CHANNELS * POOLED[0] * POOLED[1] * POOLED[2], 3)

    def forward(self, volume):
        return self.head(F.adaptive_max_pool3d(volume * self.scale, POOLED).flatten(1))


VOLUMES = ec.register_case(ec.Case(
    name="field_pytorch_volumes", model=ScaledPool,
    data=lambda: (torch.randn(24, CHANNELS, *VOLUME), torch.randint(0, 3, (24,))),
    loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=12, steps=2,
    description="3-D volumes of 4 channels scaled per channel, adaptive-max-pooled to 2x3x5 and classified"))

COMPILED = weakref.WeakKeyDictionary()  # each run's compiled model, by its optimizer


def step_with(model, optimizer, batch, memory_format=torch.contiguous_format):
    if optimizer not in COMPILED:
        torch._dynamo.reset()
        model.to(memory_format=memory_format)
        COMPILED[optimizer] = torch.compile(model, backend="inductor")
    inputs, targets = batch
    loss = F.cross_entropy(COMPILED[optimizer](inputs.to(memory_format=memory_format)), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    return step_with(model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    """The model and its batches in channels_last_3d, as recommended for 3-D convolutional models."""
    return step_with(model, optimizer, batch, memory_format=torch.channels_last_3d)


def buggy():
    return ec.check_step(VOLUMES, train_step_as_reported)


def fixed():
    return ec.check_step(VOLUMES, train_step)
