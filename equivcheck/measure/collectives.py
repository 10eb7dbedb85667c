"""Counting what DDP communicates: no_sync() exists to skip all-reduces, so prove that it does."""

import dataclasses

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


@dataclasses.dataclass
class CommCounter:
    """A DDP communication hook's state: counts every gradient bucket, then all-reduces it as usual.

    A *sync* is one synchronised backward pass: DDP hands its buckets to the hook one by one and
    the last bucket closes the round, whatever the number of buckets.
    """

    process_group: dist.ProcessGroup | None = None
    syncs: int = 0
    bytes: int = 0

    @classmethod
    def attach(cls, module: DistributedDataParallel) -> "CommCounter":
        counter = cls(module.process_group)
        module.register_comm_hook(counter, _counting_allreduce)
        return counter

    def take(self) -> tuple[int, int]:
        """The syncs and bytes since the last call (one optimizer step's worth)."""
        taken = (self.syncs, self.bytes)
        self.syncs = self.bytes = 0
        return taken


# DDP inspects the hook's annotations at run time, so they must be real objects, not strings.
def _counting_allreduce(counter: CommCounter, bucket: dist.GradBucket):
    buffer = bucket.buffer()
    counter.bytes += buffer.numel() * buffer.element_size()
    counter.syncs += int(bucket.is_last())
    return default_hooks.allreduce_hook(counter.process_group, bucket)
