"""Regimes that train on several ranks: DistributedDataParallel (with and without no_sync) and DataParallel.

Each rank takes its contiguous shard of every global batch (12 samples over 5 ranks: 3,3,2,2,2).
DDP averages gradients over ranks equally, so the faithful loss of a rank is its loss *sum* times
the world size over the item count of the whole global batch: the average of those is the global
mean, however unevenly the items fall. These regimes run inside a process group: equivcheck's
worker pool, or a launcher's (torchrun). A rank's ``train_step`` returns its *share* of the global
loss; dispatch adds the ranks' shares up, so no extra collective is spent on reporting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..case import Batch, Case, Objective
from ..device import BACKENDS, DEFAULT_DEVICE, RankPlacement, gpus, place_ranks, rank_device
from ..errors import InvalidArgument, expect_int, expect_number
from ..measure.collectives import attach_counter
from ..process.torch_imports import is_dtensor
from .aligned_dropout import aligned_dropout
from .base import CommunicationCounter, Pitfall, Regime, finish_step
from .local import FullBatch
from .loop import backward_chunks

def shard(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous slice of the global batch."""
    return Batch(batch.inputs.tensor_split(world_size)[rank], batch.targets.tensor_split(world_size)[rank], batch.count)


def set_mesh_world_size(regime: Regime, dimensions: tuple[str, ...]) -> None:
    """A mesh regime's world size, derived from its ``dimensions`` (``dp * tp``), each checked an integer; a
    world_size given must be that product."""
    for name in dimensions:
        expect_int(name, getattr(regime, name))
    ranks = math.prod(getattr(regime, name) for name in dimensions)
    if regime.world_size not in (0, ranks):
        raise InvalidArgument.value("world_size", regime.world_size, f"{' * '.join(dimensions)} = {ranks}, or left out")
    object.__setattr__(regime, "world_size", ranks)


def whole_from(owner: int, group, tensor: Tensor) -> Tensor:
    """``tensor`` whole on the rank ``owner`` of ``group`` (a DTensor gathered there), broadcast to every rank of it:
    the harness's read-back of what one rank holds, left out of the counts."""
    from ..measure.collectives import uncounted

    with uncounted():
        whole = (tensor.full_tensor() if is_dtensor(tensor) else tensor.detach().clone()).contiguous()
        dist.broadcast(whole, src=dist.get_global_rank(group, owner), group=group)
    return whole


@dataclasses.dataclass(frozen=True)
class Distributed(Regime):
    """Common ground of the DDP regimes: world size, backend, device, the wrapper and its options."""

    # Required in every spec: a bare `world_size: int` would take the base's class value (1) as its default,
    # and a DDP check on one rank, which shards nothing, passes whatever the step does with the world size.
    world_size: int = dataclasses.field()
    backend: str = "auto"
    distributed = True
    syncs_per_step = 1

    def __post_init__(self) -> None:
        expect_int("world_size", self.world_size, minimum=1)
        if self.backend not in BACKENDS:
            raise InvalidArgument.value("backend", self.backend, f"one of {', '.join(BACKENDS)}")

    def validate(self, case: Case) -> None:
        super().validate(case)
        if self.world_size > case.batch_size:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: world_size={self.world_size} is not allowed: expected "
                f"an integer from 1 to {case.batch_size} (the case's batch_size: every rank needs a sample)"
            )

    def placement(self, device: str) -> RankPlacement:
        return place_ranks(self.world_size, device, self.backend)

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        if self.placement(device).on_gpus and gpus() < self.world_size:
            return f"nccl needs one CUDA device per rank: {self.world_size} asked, {gpus()} found"
        return None

    def device(self, asked: str = DEFAULT_DEVICE) -> torch.device:
        """A rank's own: its GPU under nccl, else the CPU (the placement chose the group's backend)."""
        return rank_device(dist.get_backend(), dist.get_rank())

    def ddp_options(self) -> dict:
        return {}

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        return self.ddp(model)

    def ddp(self, module: nn.Module) -> DistributedDataParallel:
        """``module`` in DistributedDataParallel with this regime's options, on this rank's device."""
        device_ids = [self.device().index] if dist.get_backend() == "nccl" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self.ddp_options())

    def count_communication(self, module: nn.Module) -> CommunicationCounter:
        return attach_counter(module)

    def random_streams(self, model, optimizer, inputs):
        """Every rank draws the masks one process draws for the global batch, and applies its own rows of them."""
        return aligned_dropout(model, optimizer, inputs, str(self))

    def full_tensor(self, tensor: Tensor, name: str = "") -> Tensor:
        """A sharded tensor (FSDP2's DTensor, from a regime or a team's own wrap) gathered whole."""
        return tensor.full_tensor() if is_dtensor(tensor) else tensor

    def rank_shard(self, batch: Batch) -> Batch:
        return shard(batch, dist.get_rank(), dist.get_world_size())

    def rank_part(self, objective: Objective, batch: Batch) -> Callable[[Tensor, Tensor], Tensor]:
        """A rank's (micro-)batch loss: its share of the global batch's objective times the world size (DDP averages
        the ranks' gradients)."""
        return lambda output, targets: objective.share(output, targets, batch) * self.world_size


@dataclasses.dataclass(frozen=True)
class DdpOptions:
    """DistributedDataParallel's own options, as spec fields (``ddp:world_size=2,bucket_cap_mb=0.001``): each
    changes how DDP buckets, hooks or broadcasts, and none may change the gradients."""

    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_number("bucket_cap_mb", self.bucket_cap_mb, minimum=0, maximum=math.inf, strict=True)

    def ddp_options(self) -> dict:
        """The options given, and only those: DDP warns about some (broadcast_buffers) merely for being passed."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DdpOptions)
                if getattr(self, f.name) != f.default}


DDP_OPTIONS = tuple(f.name for f in dataclasses.fields(DdpOptions))


@dataclasses.dataclass(frozen=True)
class Ddp(DdpOptions, Distributed):
    name = "ddp"
    summary = "W ranks, each its shard of the global batch, loss sum * W / global items; DDP averages"

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        local = self.rank_part(objective, batch)(objective.forward(model, mine.inputs, mine.targets), mine.targets)
        objective.backward(local)
        finish_step(optimizer, objective)
        return local.detach() / self.world_size


@dataclasses.dataclass(frozen=True)
class Accumulating(Distributed):
    """A DDP regime that accumulates ``chunks`` micro-batches of its shard per optimizer step."""

    chunks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_int("chunks", self.chunks)

    def validate(self, case: Case) -> None:
        super().validate(case)
        smallest = case.batch_size // self.world_size
        if self.chunks > smallest:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: chunks={self.chunks} is not allowed: expected an "
                f"integer from 1 to {smallest} (the smallest shard of batch_size={case.batch_size} over "
                f"world_size={self.world_size})"
            )

    def micro_batches(self, case: Case) -> int:
        return self.chunks

    def sync_context(self, model: nn.Module, last: bool):
        """Skip the all-reduce on all micro-batches but the last: what no_sync() is for."""
        return contextlib.nullcontext() if last else model.no_sync()

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        total = backward_chunks(objective.forward_of(model), mine.inputs, mine.targets, self.chunks,
                                self.rank_part(objective, batch),
                                objective=objective, around=lambda last: self.sync_context(model, last))
        finish_step(optimizer, objective)
        return total / self.world_size


@dataclasses.dataclass(frozen=True)
class DdpNoSync(DdpOptions, Accumulating):
    name = "ddp_no_sync"
    summary = "each rank accumulates K micro-batches, no_sync() on all but the last: one all-reduce per step"


@dataclasses.dataclass(frozen=True)
class DdpNoSyncFindUnused(Accumulating):
    name = "ddp_no_sync_find_unused"
    summary = "ddp_no_sync with find_unused_parameters=True (a trap when micro-batches use different parameters)"

    def ddp_options(self) -> dict:
        return {"find_unused_parameters": True}


@dataclasses.dataclass(frozen=True)
class DdpNoSyncStaticGraph(Accumulating):
    name = "ddp_no_sync_static_graph"
    summary = "ddp_no_sync with static_graph=True (a trap: the graph is not the same every iteration)"
    trap = ("DDP's reducer fails an internal assert (expect_autograd_hooks_) on the second backward of a step "
            "under no_sync() with static_graph=True (torch 2.13): it crashes whenever chunks >= 2")

    def ddp_options(self) -> dict:
        return {"static_graph": True}


@dataclasses.dataclass(frozen=True)
class DdpSyncEveryMicroBatch(DdpOptions, Accumulating):
    name = "ddp_sync_every_micro_batch"
    summary = "PITFALL: accumulation under DDP without no_sync(): right numbers, K all-reduces per step"
    pitfall = Pitfall("gradient sync on every micro-batch", twin="ddp_no_sync")

    def sync_context(self, model, last):
        return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class DdpMeanLoss(Distributed):
    name = "ddp_mean_loss"
    summary = "PITFALL: each rank's *mean* loss; DDP averages ranks equally, wrong when their item counts differ"
    pitfall = Pitfall("per-rank mean loss under DDP (token or shard imbalance)", twin="ddp")

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        local = objective.mean(objective.forward(model, mine.inputs, mine.targets), mine.targets)
        objective.backward(local)
        finish_step(optimizer, objective)
        return local.detach() / self.world_size


@dataclasses.dataclass(frozen=True)
class DdpPaddedSampler(DdpMeanLoss):
    name = "ddp_padded_sampler"
    summary = "PITFALL: a sampler pads shards to equal size by repeating samples; repeated ones count twice"
    pitfall = Pitfall("sampler pads micro-batches by repeating samples", twin="ddp")

    def rank_shard(self, batch: Batch) -> Batch:
        """DistributedSampler's split: pad the index list from its start, then every W-th index per rank."""
        per_rank = math.ceil(len(batch) / self.world_size)
        indices = list(range(len(batch)))
        indices += indices[: per_rank * self.world_size - len(indices)]
        mine = torch.tensor(indices[dist.get_rank() :: self.world_size], device=batch.targets.device)
        return Batch(batch.inputs[mine], batch.targets[mine], batch.count)


class OnEveryGpu:
    """Where nn.DataParallel trains: over every visible GPU, the model kept on the first. It needs two or
    more; with fewer its regimes are skipped with that reason, never emulated."""

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        return None if gpus() >= 2 else f"DataParallel needs at least 2 CUDA devices; {gpus()} found"

    def device(self, asked: str = DEFAULT_DEVICE) -> torch.device:
        return torch.device("cuda", 0)


@dataclasses.dataclass(frozen=True)
class DataParallel(OnEveryGpu, FullBatch):
    """Full-batch training through nn.DataParallel: it scatters the batch and gathers outputs itself."""

    name = "data_parallel"
    summary = "torch.nn.DataParallel over every visible GPU (needs 2 or more; skipped, never emulated, otherwise)"
    anchorable = False  # its replicas run forward on every GPU: not measured anchored (no two GPUs here)

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        return nn.DataParallel(model)
