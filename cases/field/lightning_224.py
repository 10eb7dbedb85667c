"""Lightning-AI/pytorch-lightning#224: the trainer never called ``set_epoch``, so every epoch drew the same order.

``DistributedSampler`` seeds its shuffle with ``seed + epoch``, and its epoch moves only when the training loop calls
``sampler.set_epoch(epoch)``. Lightning's trainer never called it, so under DDP every epoch drew the permutation of
the first: the same shards on the same ranks and the same global batches, epoch after epoch. The training the team
meant, in one process with ``shuffle=True``, draws a new order every epoch. The fix calls ``set_epoch`` at the start
of each epoch. The loop shards the whole epoch with its own sampler (``batches.whole_dataset``); the reference is the
loop the team meant, in one process: a new permutation each epoch, from the same seed as the ranks' sampler.
"""

import dataclasses

import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("Lightning-AI/pytorch-lightning", "issue", 224, "ddp",
          "DistributedSampler.set_epoch never called: every epoch trained on the first epoch's order",
          fixed_by="pull #225", fix_acts="forward")

TWO_EPOCHS = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_two_epochs", epochs=2, description="mlp over 2 epochs of 3 steps"))


def training_step(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)  # equal shards: DDP's average is the global mean


def fit(model, optimizer, loader, epochs, calls_set_epoch=True):
    """The trainer's loop: an epoch of the train dataloader, one optimizer step per batch."""
    for epoch in range(epochs):
        if calls_set_epoch and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            training_step(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def train_loop(model, optimizer, batches, calls_set_epoch=True):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    sampler = DistributedSampler(batches.whole_dataset, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(batches.whole_dataset, batch_size=batches.batch_size, sampler=sampler)
    fit(model, optimizer, loader, batches.epochs, calls_set_epoch)


def train_loop_as_reported(model, optimizer, batches):
    train_loop(model, optimizer, batches, calls_set_epoch=False)


def buggy():
    return ec.check_loop(TWO_EPOCHS, train_loop_as_reported, reference=train_loop, world_size=2)


def fixed():
    return ec.check_loop(TWO_EPOCHS, train_loop, reference=train_loop, world_size=2)
