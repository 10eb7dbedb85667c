"""kohya-ss/sd-scripts#924: the training scripts ran forward and backward through DDP's unwrapped ``.module``.

The fine-tuning scripts let accelerate wrap the models in DistributedDataParallel and then swapped each one for its
``.module`` (``transform_if_model_is_DDP``) before the training loop. DDP readies its gradient all-reduce in its own
forward; a forward through the bare module never does, so no gradient was ever averaged: each GPU trained its own
copy on its own share of the data and the copies drifted apart, where one process would step on the gradient of
the whole global batch. The fix keeps the wrapped model for training and unwraps it only to save or sample.
"""

import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("kohya-ss/sd-scripts", "issue", 924, "ddp",
          "forward and backward through the unwrapped DDP .module: gradients never all-reduced",
          fixed_by="pull #989", fix_acts="communication")


def transform_if_model_is_ddp(model):
    """The helper the scripts called before training: DDP's inner module, the model otherwise."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def train_step(model, optimizer, batch, prepare=lambda model: model):
    net = prepare(model)
    inputs, targets = batch  # this rank's 6 of mlp's 12 samples: equal shards, so the ranks' means average right
    loss = F.cross_entropy(net(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, prepare=transform_if_model_is_ddp)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("mlp", train_step, world_size=2)
