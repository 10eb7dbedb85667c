"""Counting what DDP communicates: no_sync() exists to skip all-reduces, so prove that it does."""

import dataclasses

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


@dataclasses.dataclass
class CommCounter:
    """A DDP communication hook's state: counts every gradient bucket, then all-reduces it as usual.

    A *sync* is one synchronised backward pass of one wrapper: DDP hands its buckets to the hook one by
    one and the last bucket closes the round, whatever the number of buckets. A model wrapped in parts
    (trunk and head each in DDP) makes one sync per wrapper per step.
    """

    process_group: dist.ProcessGroup | None = None
    syncs: int = 0
    bytes: int = 0
    wrappers: int = 0

    @classmethod
    def attach(cls, module: nn.Module) -> "CommCounter":
        """Count every DDP wrapper in ``module``: the module itself, or the wrappers it holds."""
        counter = cls()
        for wrapper in (m for m in module.modules() if isinstance(m, DistributedDataParallel)):
            counter.process_group = wrapper.process_group
            counter.wrappers += 1
            wrapper.register_comm_hook(counter, _counting_allreduce)
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
