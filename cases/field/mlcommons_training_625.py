"""mlcommons/training#625: each worker seeded its ``DistributedSampler`` differently, so the shards overlapped.

The UNet3D reference built every worker's ``DistributedSampler(shuffle=True)`` with that worker's own seed. The
sampler hands rank r every W-th index of one permutation of the dataset, which only partitions the data when every
rank draws the same permutation; with a seed per rank each sliced a different one, so in an epoch 20 to 30% of the
samples went to two workers and about as many to none. One process sees each sample once per epoch. The fix gives
every rank one shared seed and leaves the per-epoch variation to ``set_epoch``. The loop shards the whole epoch
with its own sampler (``batches.whole_dataset``), and the reference is the same loop in one process, where the
sampler's one replica takes the whole permutation: its global batches are what the ranks' local batches make up.
"""

import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("mlcommons/training", "pull", 625, "ddp",
          "DistributedSampler seeded per rank: the shards overlap and some samples are never seen", fix_acts="forward")

SHUFFLING_SEED = 1234


def train_loop(model, optimizer, batches, seed_of=lambda rank: SHUFFLING_SEED):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    sampler = DistributedSampler(batches.whole_dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=seed_of(rank))
    loader = DataLoader(batches.whole_dataset, batch_size=batches.batch_size, sampler=sampler)
    for epoch in range(batches.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            F.cross_entropy(model(inputs), targets).backward()  # equal shards: DDP's average is the global mean
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def train_loop_as_reported(model, optimizer, batches):
    train_loop(model, optimizer, batches, seed_of=lambda rank: SHUFFLING_SEED + rank)


def buggy():
    return ec.check_loop("mlp", train_loop_as_reported, reference=train_loop, world_size=2)


def fixed():
    return ec.check_loop("mlp", train_loop, reference=train_loop, world_size=2)
