"""pfnet/pytorch-pfn-extras#117: a BatchNorm inside a checkpointed segment updated its running statistics twice.

``torch.utils.checkpoint`` runs a segment's forward once for the loss and again in backward to rebuild its
activations. A training-mode BatchNorm in the segment updates ``running_mean`` and ``running_var`` on both runs, so
every step applied two exponential-moving-average updates with the same batch statistics instead of one. The
gradients are unchanged (both runs normalise by the batch's own statistics), but the statistics used at
evaluation, and saved with the model, drift from those of training without checkpointing. The fix is a drop-in
``checkpoint`` that sets each BatchNorm's momentum m to 1 - sqrt(1 - m) inside the segment, so two updates move
the statistics as far as one update with m.
"""

import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pfnet/pytorch-pfn-extras", "pull", 117, "checkpointing",
          "checkpoint() reran BatchNorm in backward: running statistics updated twice a step", fix_acts="state 1")


def _patch_bn_momentum(module):
    """Once per module: a momentum whose two updates with the same statistics equal one update with the old."""
    if getattr(module, "_bn_momentum_patched", False):
        return
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is not None:
        module.momentum = 1 - (1 - module.momentum) ** 0.5
    for child in module.children():
        _patch_bn_momentum(child)
    module._bn_momentum_patched = True


def bn_aware_checkpoint(function, *args):
    """The fix: ``torch.utils.checkpoint.checkpoint`` with every BatchNorm in the segment patched first."""
    _patch_bn_momentum(function)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def torch_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


# batchnorm_cnn: Conv2d, BatchNorm2d, ReLU | Flatten, Linear. The convolutional trunk is the checkpointed segment.
def train_step(model, optimizer, batch, checkpoint=bn_aware_checkpoint):
    inputs, targets = batch
    features = checkpoint(model[:3], inputs)
    F.cross_entropy(model[3:](features), targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, checkpoint=torch_checkpoint)


def buggy():
    return ec.check_step("batchnorm_cnn", train_step_as_reported)


def fixed():
    return ec.check_step("batchnorm_cnn", train_step)
