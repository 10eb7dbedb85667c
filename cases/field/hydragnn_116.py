"""ORNL/HydraGNN#116: under DDP each rank divided its summed training loss by the size of the whole dataset.

HydraGNN's ``train()`` adds ``loss.item() * num_graphs`` over the batches of its loader and divided the total by
``len(loader.dataset)``, the number of samples in the whole dataset. In one process that is the number of samples
trained on; under DDP a ``DistributedSampler`` gives each rank only its 1/W of them, so every rank reported about
1/W of its mean loss and the epoch's training loss came out W times smaller than one process reports on the same
data (the gradients were not affected). The fix counts the samples the rank actually processed and divides by that
count. Scaled down so that an epoch is one global batch: each rank's epoch loss is then that step's loss.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("ORNL/HydraGNN", "pull", 116, "ddp",
          "epoch loss divided by the whole dataset's sample count on every DDP rank: W times too small",
          fix_acts="loss")


def one_global_batch():
    return torch.randn(12, 6), torch.randint(0, 3, (12,))


# mlp over 3 epochs of one global batch of 12 samples: each rank's loader holds one batch of 6 per epoch.
ONE_BATCH_EPOCHS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_one_batch_epochs", data=one_global_batch, steps=1, epochs=3,
    description="mlp over 3 epochs of one global batch of 12 samples"))


def train(loader, model, opt, counts_local_samples=True):
    """One epoch; returns the epoch's mean training loss as HydraGNN reports it."""
    num_samples_local = 0
    total_error = 0.0
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)  # equal shards: DDP's average of the ranks' means is the global mean
        loss.backward()
        opt.step()
        total_error += loss.item() * len(y)
        num_samples_local += len(y)
    return total_error / (num_samples_local if counts_local_samples else len(loader.dataset))


def train_loop(model, optimizer, batches, counts_local_samples=True):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    sampler = DistributedSampler(batches.whole_dataset, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(batches.whole_dataset, batch_size=batches.batch_size, sampler=sampler)
    losses = []
    for epoch in range(batches.epochs):
        sampler.set_epoch(epoch)
        losses.append(train(loader, model, optimizer, counts_local_samples))
    return losses


def train_loop_as_reported(model, optimizer, batches):
    return train_loop(model, optimizer, batches, counts_local_samples=False)


def buggy():
    return ec.check_loop(ONE_BATCH_EPOCHS, train_loop_as_reported, reference=train_loop, world_size=2)


def fixed():
    return ec.check_loop(ONE_BATCH_EPOCHS, train_loop, reference=train_loop, world_size=2)
