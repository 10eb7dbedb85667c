"""A team's own DDP comm hooks, as the ranks import them by name: the wraps that register a hook before handing
the model over, the steps (one registers its hook itself, on its first call), and a hook that all-reduces every
bucket twice."""

import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

CASE = "mlp"  # 12 samples per step over 2 ranks: shards of 6, so each rank's mean loss averages to the global one


def rank_loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def train_step(model, optimizer, batch):
    loss = rank_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def fp16_compressed(model):
    """The team's wrap: DDP, its buckets all-reduced in float16 (torch's own hook)."""
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


def plain_allreduce(model):
    """The team's wrap with torch's plain all-reduce hook, as DDP does without one: exact."""
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def allreduce_twice_hook(process_group, bucket):
    """A wrong hook: every bucket all-reduced twice, the second time divided again. The sum of two equal averages
    over 2 ranks, halved: the average again, so the numbers stay right and only the traffic doubles."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    dist.all_reduce(buffer, group=group)
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_twice(model):
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_twice_hook)
    return ddp


def allreduce_twice_summing_hook(process_group, bucket):
    """A wrong hook: every bucket all-reduced twice, divided only once: the gradients come out W times too big."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    dist.all_reduce(buffer, group=group)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_twice_summing(model):
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_twice_summing_hook)
    return ddp


def train_step_registering_fp16(model, optimizer, batch):
    """A step that registers its hook itself, on its first call (after equivcheck's counter is in place)."""
    if not getattr(model, "team_hooked", False):
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        model.team_hooked = True
    return train_step(model, optimizer, batch)


def train_step_registering_twice(model, optimizer, batch):
    """A step that registers a second hook on the same wrapper: torch refuses that, and so must equivcheck."""
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    return train_step(model, optimizer, batch)


def builtin_allreduce(model):
    """The team's wrap with DDP's built-in (C++) all-reduce hook: nothing in Python to wrap."""
    ddp = DistributedDataParallel(model)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    return ddp


def plain_allreduce_static_small_buckets(model):
    """The plain hook on DDP with a static graph and buckets of 104 bytes (DDP's first bucket is 1 MiB whatever the
    cap: the 103 gradients go in one bucket until DDP rebuilds its buckets by the cap, in 2)."""
    ddp = DistributedDataParallel(model, static_graph=True, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp
