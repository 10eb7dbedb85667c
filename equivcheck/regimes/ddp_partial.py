"""Seed 000's question: gradient accumulation over part of the model, inside DDP and DataParallel.

The trunk runs once on a rank's shard; the memory-hungry head accumulates over chunks of the trunk's
detached output; the trunk back-propagates once (``local.backward_detached``). DDP all-reduces only
what goes through a wrapper's own forward and backward, so the faithful construction wraps the trunk
and the head separately and keeps the head under ``no_sync()`` for all but its last chunk: one
all-reduce per wrapped module per step. Each naive version people write is a pitfall here:

- the parts reached inside one wrapper (``model.module``): DDP never all-reduces; ranks drift apart;
- seed 000's ``accum_forward`` as the wrapped head's forward: DDP ignores a backward that runs inside
  its own forward, so the head is never all-reduced (and in later steps a partial sum is);
- the head synchronised every chunk: right numbers, 1 + K all-reduces per step instead of 2.

Seed 000's own shape, the backward calls inside the wrapped head's forward, is faithful once the last
chunk's backward runs after that forward returns (``ddp_detached_partial_last_outside``): DDP ignores
the backward calls inside its forward and all-reduces the accumulated sum on the one after it.

nn.DataParallel's replicas are copies made inside autograd's graph, so their gradients flow back to the
one model whichever backward produces them: ``data_parallel_detached_partial`` is seed 000's step with
each part in nn.DataParallel. It needs 2 or more GPUs, and is skipped with that reason elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import InvalidArgument
from .base import Pitfall, finish_step
from .ddp import Accumulating, OnEveryGpu
from .local import DetachedPartial, backward_detached, backward_trunk
from .loop import backward_chunks, inputs_only


class Parts(nn.Module):
    """The model's trunk and head, each in a wrapper of its own; the parameters stay the model's."""

    def __init__(self, trunk: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head


def split_modules(model, objective, regime) -> tuple[nn.Module, nn.Module]:
    """The case's ``(trunk, head)`` of ``model``, checked to be modules: a wrapper takes nothing else."""
    parts = objective.split(model)
    for role, part in zip(("trunk", "head"), parts):
        if not isinstance(part, nn.Module):
            raise InvalidArgument(f"regime {str(regime)!r}: the case's split gave the {role} as "
                                  f"{type(part).__name__}: expected an nn.Module, which {regime.name} wraps on its own")
    return parts


@dataclasses.dataclass(frozen=True)
class DdpDetachedPartial(Accumulating):
    name = "ddp_detached_partial"
    summary = ("seed 000 under DDP: trunk and head each in DDP, the head accumulated over K chunks of the detached "
               "trunk output under no_sync() but the last; one all-reduce of each per step")
    needs_split = True

    def wrap(self, model, objective):
        trunk, head = split_modules(model, objective, self)
        return Parts(self.ddp_part(trunk), self.ddp_part(head))

    def ddp_part(self, part: nn.Module) -> nn.Module:
        """``part`` in DDP, unless it has nothing to train (a frozen trunk): DDP refuses such a module, and
        there is nothing of it to synchronise."""
        return self.ddp(part) if any(p.requires_grad for p in part.parameters()) else part

    def sync_context(self, model, last):
        wrapped = isinstance(model, DistributedDataParallel)
        return super().sync_context(model, last) if wrapped else contextlib.nullcontext()

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        total = backward_detached(model.trunk, model.head, mine.inputs, mine.targets, self.chunks,
                                  self.rank_part(objective, batch), objective,
                                  around=lambda last: self.sync_context(model.head, last))
        finish_step(optimizer, objective)
        return total / self.world_size


@dataclasses.dataclass(frozen=True)
class DdpDetachedPartialSyncEveryChunk(DdpDetachedPartial):
    name = "ddp_detached_partial_sync_every_chunk"
    summary = "PITFALL: ddp_detached_partial without no_sync(): right numbers, 1 + K all-reduces per step instead of 2"
    pitfall = Pitfall("gradient sync on every micro-batch", twin="ddp_detached_partial")

    def sync_context(self, model, last):
        return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class DdpDetachedPartialBypass(DdpDetachedPartial):
    name = "ddp_detached_partial_bypass"
    summary = ("PITFALL: the whole model in one DDP, the step reaching its trunk and head inside it (model.module): "
               "DDP never all-reduces, every rank keeps its own gradients")
    pitfall = Pitfall("gradients never all-reduced", twin="ddp_detached_partial")

    def wrap(self, model, objective):
        return self.ddp(model)

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        trunk, head = objective.split(model.module)  # the bug: around the wrapper, so no hook ever fires
        total = backward_detached(trunk, head, mine.inputs, mine.targets, self.chunks,
                                  self.rank_part(objective, batch), objective)
        finish_step(optimizer, objective)
        return total / self.world_size


class AccumulatingHead(nn.Module):
    """Seed 000's ``accum_forward`` as a module: its forward back-propagates chunks of the detached
    features itself. It returns the summed loss, the detached features (whose gradient the chunks
    accumulate) and, with ``last_outside``, the last chunk's loss for the caller to back-propagate."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, features, targets, chunks, part_loss, objective, last_outside=False):
        detached = features.detach().requires_grad_()
        pieces = chunks - 1 if last_outside else chunks  # back-propagated here, inside the forward
        inside = len(targets) - (len(targets.tensor_split(chunks)[-1]) if last_outside else 0)
        total = (backward_chunks(inputs_only(self.head), detached[:inside], targets[:inside], pieces, part_loss,
                                 objective=objective) if pieces else 0.0)
        if not last_outside:
            return total, detached, None
        last = part_loss(self.head(detached[inside:]), targets[inside:])
        return total + last.detach(), detached, last


@dataclasses.dataclass(frozen=True)
class DdpDetachedPartialInForward(DdpDetachedPartial):
    name = "ddp_detached_partial_in_forward"
    summary = ("PITFALL: seed 000's accum_forward as the DDP-wrapped head's forward: DDP ignores a backward inside "
               "its own forward, so the head's gradients are not all-reduced")
    pitfall = Pitfall("gradients never all-reduced", twin="ddp_detached_partial_last_outside")

    last_outside: ClassVar[bool] = False  # the last chunk's backward after the wrapped forward returns

    def wrap(self, model, objective):
        trunk, head = split_modules(model, objective, self)
        return Parts(self.ddp_part(trunk), self.ddp_part(AccumulatingHead(head)))

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        features = model.trunk(mine.inputs)
        total, detached, last = model.head(features, mine.targets, self.chunks, self.rank_part(objective, batch),
                                           objective, last_outside=self.last_outside)
        if last is not None:
            objective.backward(last)  # after DDP's forward: its hooks fire, the head's sum is all-reduced
        backward_trunk(features, detached)
        finish_step(optimizer, objective)
        return total / self.world_size


@dataclasses.dataclass(frozen=True)
class DdpDetachedPartialLastOutside(DdpDetachedPartialInForward):
    name = "ddp_detached_partial_last_outside"
    summary = ("seed 000's accum_forward inside the DDP-wrapped head, all chunks but the last back-propagated in the "
               "forward, the last after it returns: DDP all-reduces the head's whole sum once")
    pitfall = None  # the faithful twin of its parent
    last_outside = True


@dataclasses.dataclass(frozen=True)
class DataParallelDetachedPartial(OnEveryGpu, DetachedPartial):
    """Seed 000's step with the trunk and the head each in nn.DataParallel: every chunk is scattered over
    the GPUs, and the replicas' gradients are summed into the one model by DataParallel's own graph."""

    name = "data_parallel_detached_partial"
    summary = ("seed 000 under nn.DataParallel: trunk and head each in DataParallel, the head accumulated per chunk "
               "(needs 2 or more GPUs; skipped, never emulated, otherwise)")

    def wrap(self, model, objective):
        trunk, head = split_modules(model, objective, self)
        return Parts(nn.DataParallel(trunk), nn.DataParallel(head))

    def parts(self, model, objective):
        return model.trunk, model.head
