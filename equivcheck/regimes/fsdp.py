"""FSDP2: ``fully_shard`` on every block and on the root, each rank its shard of the global batch.

Parameters, gradients and optimizer state live as DTensor shards (1/W of each on every rank);
FSDP2 all-gathers a block's parameters for its forward and backward and reduce-scatters its
gradients, averaged over ranks like DDP, so a rank's faithful loss is the same as under DDP: its sum
times the world size over the global batch's items. The harness reads gradients and weights back
whole through ``full_tensor``. Accumulation turns off gradient sync
(``set_requires_gradient_sync(False)``) on all micro-batches but the last, as ``no_sync()`` does for DDP.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from ..case import Case, Objective
from ..device import DEFAULT_DEVICE
from ..errors import InvalidArgument, expect_int
from ..precision import Precision, Tolerance
from ..process.torch_imports import fsdp2, fsdp2_missing, is_dtensor
from .base import UNIT_ROUNDOFF, Pitfall, expect_max_norm, finish_step, parameters_of, reduced_in, scale_to
from .ddp import Accumulating, Distributed

REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fsdp's reduce_dtype=, by its name in a spec
assert set(REDUCE_DTYPES) == set(UNIT_ROUNDOFF)


def shard_blocks(model: nn.Module, mesh, reshard_after_forward: bool, reduce_dtype: str = "") -> nn.Module:
    """``fully_shard`` on every direct child that holds parameters (a block; each member of a ModuleList, which has no
    forward of its own: a mixture's experts), then on the root. A block that shares a parameter with another (a head
    tied to the token embedding) is left to the root: FSDP2 keeps a parameter in one group, and refuses one shared
    across two. ``reduce_dtype`` ("bf16", "fp16"): each group's gradients reduce-scattered in that type
    (``MixedPrecisionPolicy(reduce_dtype=...)``, the parameters left in their own)."""
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if reduce_dtype:
        options["mp_policy"] = fsdp2().MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[reduce_dtype])
    blocks = [member for child in model.children()
              for member in (child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else (child,))]
    owners = collections.Counter(id(p) for block in blocks for p in block.parameters())
    for block in blocks:
        held = list(block.parameters())
        if held and all(owners[id(p)] == 1 for p in held):
            fsdp2().fully_shard(block, **options)
    return fsdp2().fully_shard(model, **options)


class ShardedByFsdp:
    """How every FSDP2 regime wraps (counting and reading back whole are every distributed regime's: see
    ``Distributed``); ``reshard_after_forward`` (default true) frees gathered parameters after each forward."""

    reshard_after_forward: bool
    reduce_dtype = ""  # the type gradients are reduced in, where not the parameters' own (fsdp's option)
    sync_collective = "reduce-scattered"

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        return fsdp2_missing() or super().unavailable(device)

    @property
    def syncs_per_step(self) -> int:
        """One reduce-scatter per block per step; none with one rank, where FSDP2 calls no collective."""
        return 0 if self.world_size == 1 else 1

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        # Where the model is: a CUDA precision mode puts it on the GPU whatever the backend.
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
        return shard_blocks(model, mesh, self.reshard_after_forward, self.reduce_dtype)


class ClipsShards:
    """``max_norm=M``: clip the whole gradient to M before each step, as ``clip_grad_norm_`` over FSDP2's DTensor
    gradients does (every logical element counted once: each shard's squares summed over the ranks that hold it)."""

    max_norm: float

    def clips_at(self) -> float | None:
        return self.max_norm if self.max_norm < math.inf else None

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        local = self.rank_part(objective, batch)(objective.forward(model, mine.inputs, mine.targets), mine.targets)
        objective.backward(local)
        if self.max_norm < math.inf:
            objective.scaler.unscale_(optimizer)
            scale_to(optimizer, self.max_norm, self.total_norm(optimizer))
        finish_step(optimizer, objective)
        return local.detach() / self.world_size

    def total_norm(self, optimizer) -> Tensor:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters_of(optimizer) if p.grad is not None])
        return norm.full_tensor() if is_dtensor(norm) else norm


@dataclasses.dataclass(frozen=True)
class Fsdp(ClipsShards, ShardedByFsdp, Distributed):
    name = "fsdp"
    summary = ("FSDP2 fully_shard per block and root, W ranks each its shard; reduce-scatter averages like DDP; "
               "max_norm=M clips the whole gradient; reduce_dtype=bf16 or fp16 reduces in that type, compared at "
               "its own error bound")
    reshard_after_forward: bool = True
    max_norm: float = math.inf
    reduce_dtype: str = ""  # FSDP2's MixedPrecisionPolicy(reduce_dtype=...): lossy, so compared at its bound

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_max_norm(self.max_norm)
        if self.reduce_dtype and self.reduce_dtype not in REDUCE_DTYPES:
            raise InvalidArgument.value("reduce_dtype", self.reduce_dtype,
                                        f"one of {', '.join(REDUCE_DTYPES)}, or left out (the parameters' own type)")

    def tolerance_for(self, case: Case, precision: Precision, base: Tolerance) -> Tolerance | None:
        """Reduced in a 16-bit type, the averaged gradient carries its roundings: compared at ``ddp_hook``'s bound."""
        if not self.reduce_dtype:
            return None
        return reduced_in(self.reduce_dtype, self.world_size, precision, base,
                          f"FSDP2's reduce-scatter in {self.reduce_dtype} over {self.world_size} ranks")


@dataclasses.dataclass(frozen=True)
class FsdpMeanLoss(Fsdp):
    """Each rank's *mean* loss under FSDP2, whose reduce-scatter averages the ranks equally: wrong where their item
    counts differ, as under DDP; with ``reduce_dtype=bf16`` the fault a lossy reduction's bound must not hide."""

    name = "fsdp_mean_loss"
    summary = "PITFALL: each rank's *mean* loss; FSDP2 averages ranks equally, wrong when their item counts differ"
    pitfall = Pitfall("per-rank mean loss under DDP (token or shard imbalance)", twin="fsdp")  # DDP's class

    def rank_part(self, objective: Objective, batch):
        return objective.mean


@dataclasses.dataclass(frozen=True)
class FsdpClipAveraged(Fsdp):
    """Each rank's norm of the shards it holds, averaged over the ranks, as DeepSpeed's clip divided the ranks' summed
    norms by the data-parallel size (deepspeedai/DeepSpeed#8475): a mean of partial norms is no norm of the whole."""

    name = "fsdp_clip_averaged"
    summary = "PITFALL: clipping by each rank's norm of its own shards, averaged over the ranks"
    pitfall = Pitfall("clipping by a norm averaged over the ranks (FSDP2)", twin="fsdp")

    def total_norm(self, optimizer) -> Tensor:
        norm = _local_norm(optimizer)
        dist.all_reduce(norm)
        return norm / dist.get_world_size()


@dataclasses.dataclass(frozen=True)
class Hsdp(ClipsShards, ShardedByFsdp, Distributed):
    """HSDP: FSDP2 on a ``replicate x shard`` mesh (``fully_shard(..., mesh=mesh)`` with a 2-D mesh): R replicas, each
    sharding the model over its S ranks. A block's gradient is reduce-scattered within its shard group, then its shard
    all-reduced across the replicas; both average, so the R * S ranks are averaged as DDP averages ranks and a rank's
    faithful loss is ``fsdp``'s: its sum times the world size (R * S) over the global batch's items. Each of the R * S
    ranks takes its own contiguous shard of the global batch (row-major mesh: rank = replica * S + shard index).

    Counted as ``fsdp`` is (``ShardedCommCounter``): one sync per block per step, the block's reduce-scatter, or where
    its shard group holds one rank (``shard=1``: pure replication) its replicas' all-reduce, which FSDP2's all-reduce
    hook counts. A sync's bytes are the reduce-scatter's (the padded unsharded gradient), with ``shard=1`` the
    all-reduced gradient's; FSDP2's all-reduces across replicas are in ``collectives`` as ``all_reduce``."""

    name = "hsdp"
    summary = ("HSDP: FSDP2 on a replicate x shard mesh (R replicas of S shards), R * S ranks each its shard of the "
               "batch; FSDP2 averages over every rank")
    world_size: int = dataclasses.field(default=0, metadata={"derived": "replicate * shard"})
    replicate: int = dataclasses.field(kw_only=True)
    shard: int = dataclasses.field(kw_only=True)
    reshard_after_forward: bool = True
    max_norm: float = math.inf  # each rank its shard, loss sum * world size / items: FSDP2 averages all R * S ranks

    def __post_init__(self) -> None:
        expect_max_norm(self.max_norm)
        expect_int("replicate", self.replicate)
        expect_int("shard", self.shard)
        if self.world_size not in (0, self.replicate * self.shard):
            raise InvalidArgument.value("world_size", self.world_size,
                                        f"replicate * shard = {self.replicate * self.shard}, or left out")
        object.__setattr__(self, "world_size", self.replicate * self.shard)
        super().__post_init__()

    @property
    def sync_collective(self) -> str:
        """What one sync does, as the communication verdict says it: with one rank per shard group FSDP2 only
        all-reduces across the replicas."""
        if self.shard == 1:
            return "all-reduced"
        return "reduce-scattered" if self.replicate == 1 else "reduce-scattered (then all-reduced over replicas)"

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        mesh = init_device_mesh(next(model.parameters()).device.type, (self.replicate, self.shard),
                                mesh_dim_names=("replicate", "shard"))
        return shard_blocks(model, mesh, self.reshard_after_forward)


@dataclasses.dataclass(frozen=True)
class HsdpClipOverReplicas(Hsdp):
    """The squares of each rank's shards summed over every rank, replicas too: each element is counted once per
    replica (as a clip that sums a replicated parameter's squares over a group that holds it several times does:
    veomni#184, hyper-parallel#526)."""

    name = "hsdp_clip_over_replicas"
    summary = "PITFALL: clipping by a norm whose squares are summed over every rank, each replica's counted again"
    pitfall = Pitfall("clipping by a norm counting each replica's elements again (HSDP)", twin="hsdp")

    def total_norm(self, optimizer) -> Tensor:
        squares = _local_norm(optimizer).square()
        dist.all_reduce(squares)
        return squares.sqrt()


def _local_norm(optimizer) -> Tensor:
    """The norm of the gradient shards this rank holds."""
    local = [p.grad.to_local() for p in parameters_of(optimizer) if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))


@dataclasses.dataclass(frozen=True)
class FsdpNoSync(ShardedByFsdp, Accumulating):
    name = "fsdp_no_sync"
    summary = ("FSDP2 accumulating K micro-batches, set_requires_gradient_sync(False) on all but the last: "
               "one reduce-scatter per block per step")
    reshard_after_forward: bool = True

    def sync_context(self, model: nn.Module, last: bool):
        return contextlib.nullcontext() if last else gradient_sync_off(model)


@dataclasses.dataclass(frozen=True)
class FsdpSyncEveryMicroBatch(ShardedByFsdp, Accumulating):
    name = "fsdp_sync_every_micro_batch"
    summary = "PITFALL: accumulation under FSDP2 with gradient sync left on: right numbers, K reduce-scatters per step"
    pitfall = Pitfall("gradient sync on every micro-batch", twin="fsdp_no_sync")
    reshard_after_forward: bool = True

    def sync_context(self, model, last):
        return contextlib.nullcontext()


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module):
    """FSDP2's no_sync(): gradients accumulate unsharded on each rank until sync is turned back on."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
