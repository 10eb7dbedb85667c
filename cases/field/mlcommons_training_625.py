"""mlcommons/training#625: each worker seeded its ``DistributedSampler`` differently, so the shards overlapped.

The UNet3D reference built every worker's ``DistributedSampler(shuffle=True)`` with that worker's own seed. The
sampler hands rank r every W-th index of one permutation of the dataset, which only partitions the data when every
rank draws the same permutation; with a seed per rank each sliced a different one, so in an epoch 20 to 30% of the
samples went to two workers and about as many to none. One process sees each sample once per epoch. The fix gives
every rank one shared seed and leaves the per-epoch variation to ``set_epoch``.
"""

from equivcheck.field import Bug

BUG = Bug("mlcommons/training", "pull", 625, "ddp",
          "DistributedSampler seeded per rank: the shards overlap and some samples are never seen",
          not_expressible="check_loop hands each rank its shard of every global batch, cut by equivcheck, so the "
                          "team's own DistributedSampler never chooses what a rank trains on. The API would need "
                          "check_loop to hand each rank the whole epoch's dataset, as check_eval does, and compare "
                          "the samples the ranks' samplers chose (and the updates) with one process's epoch")
