"""neuralmagic/sparseml#135: under DDP the mean loss was multiplied by the world size before its backward.

SparseML's training code multiplied each rank's mean loss by the number of processes, as if DDP added the ranks'
gradients. DDP averages them: with every rank's loss a mean over its own equal shard, the average of the ranks'
gradients is already the gradient of the global batch's mean, so the extra factor made every gradient W times the
one a single process computes over the same global batch (for SGD, a learning rate W times too large that changes
with the number of GPUs). The fix drops the factor and backpropagates the plain mean loss.
"""

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("neuralmagic/sparseml", "pull", 135, "ddp",
          "per-rank mean loss multiplied by the world size although DDP averages gradients", fix_acts="loss")


def train_step(model, optimizer, batch, loss_scale=lambda: 1):
    inputs, targets = batch  # this rank's 6 of mlp's 12 samples: equal shards, so the ranks' means average right
    loss = F.cross_entropy(model(inputs), targets) * loss_scale()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, loss_scale=dist.get_world_size)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("mlp", train_step, world_size=2)
