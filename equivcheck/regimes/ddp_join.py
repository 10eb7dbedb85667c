"""Uneven inputs under DDP: ranks that hold different numbers of micro-batches, with and without
``DistributedDataParallel.join()``, measured on gloo (torch 2.13).

What is exact, and why (docs/parallel.md has the measured figures):

* **Within one optimizer step, no_sync accumulation needs no join.** A forward and backward under
  ``no_sync()`` issue no collective at all outside a join context, so a rank that cuts its shard into
  3 micro-batches and a rank that cuts it into 2 each make exactly one gradient all-reduce per step (at
  their last backward) and meet there: ``ddp_uneven_micro_batches`` is exact, one sync per step.
* **The same inside** ``model.join()`` **crashes.** Under join every forward of a rank that has not joined
  is a collective round of its own (a one-element all-reduce telling joined ranks that it still trains,
  and one saying whether this backward synchronises), so ranks meet forward by forward: the rank with 2
  micro-batches synchronises in round 2 while the rank with 3 is in its unsynchronised round 2, and
  gloo aborts the process on the size mismatch (``op.preamble.length <= op.nbytes``):
  ``ddp_uneven_micro_batches_join`` is a trap. Synchronising every micro-batch under join does not
  crash but is wrong: a joined rank shadows a backward with *zero* buckets, and DDP all-reduces the
  accumulated gradient, so what the ranks had accumulated is divided by the world size once more.
* **Join is exact where ranks run out of whole steps**, what it was made for (an epoch's uneven tail):
  ``ddp_join`` trains every step inside one ``with model.join():``; rank r holds data for the first
  ``max(1, S - r)`` of the S global batches (W=2, S=3: rank 0 three steps, rank 1 two), each global batch
  dealt contiguously over the ranks that still hold data, each of those accumulating ``chunks``
  micro-batches with ``no_sync()`` on all but the last. A rank out of data leaves its loop and joins: in
  every later synchronised backward it all-reduces zero buckets (its share of a batch it does not
  hold) and it never steps its optimizer; when all have joined, DDP broadcasts the last joiner's
  parameters (rank 0's) to it. With each micro-batch's loss its sum times the *initial* world size over
  the global batch's items (DDP divides by the initial world size, ``divide_by_initial_world_size=True``,
  its default), every step equals full batch.
* Without join the same dealing hangs: rank 0 waits in its last step's all-reduce for a rank that has
  left its loop (``ddp_uneven_without_join``); the pool's job timeout turns that into an error.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist

from ..case import Batch
from .base import Pitfall, finish_step
from .ddp import Accumulating, DdpOptions
from .loop import backward_chunks


def micro_batches_of(rank: int, chunks: int) -> int:
    """``ddp_uneven_micro_batches``' rule: rank r cuts its shard into max(1, chunks - r) micro-batches."""
    return max(1, chunks - rank)


def steps_of(rank: int, steps: int) -> int:
    """``ddp_join``'s rule: rank r holds data for the first max(1, steps - r) global batches."""
    return max(1, steps - rank)


def holders(step: int, steps: int, world_size: int) -> int:
    """How many ranks (the first ones) hold data for global batch ``step`` of ``steps``."""
    return sum(step < steps_of(rank, steps) for rank in range(world_size))


@dataclasses.dataclass(frozen=True)
class DdpUnevenMicroBatches(DdpOptions, Accumulating):
    name = "ddp_uneven_micro_batches"
    summary = ("rank r cuts its shard into max(1, K - r) micro-batches, no_sync() on all but its last, no join: "
               "one all-reduce per rank per step, exact")

    def rank_chunks(self) -> int:
        return micro_batches_of(dist.get_rank(), self.chunks)

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        total = backward_chunks(objective.forward_of(model), mine.inputs, mine.targets, self.rank_chunks(),
                                self.rank_part(objective, batch), objective=objective,
                                around=lambda last: self.sync_context(model, last))
        finish_step(optimizer, objective)
        return total / self.world_size


@dataclasses.dataclass(frozen=True)
class DdpUnevenMicroBatchesJoin(DdpUnevenMicroBatches):
    name = "ddp_uneven_micro_batches_join"
    summary = "ddp_uneven_micro_batches inside model.join() (a trap: ranks synchronise in different join rounds)"
    trap = ("under join every forward is a collective round, so ranks with different micro-batch counts reach their "
            "synchronised backward in different rounds: gloo aborts a rank on the mismatched all-reduce "
            "(op.preamble.length <= op.nbytes, torch 2.13) whenever two ranks' counts differ (world_size >= 2, chunks >= 2)")

    def train(self, model, optimizer, batches, objective):
        with model.join():
            return [self.train_step(model, optimizer, batch, objective) for batch in batches]


@dataclasses.dataclass(frozen=True)
class DdpJoin(DdpOptions, Accumulating):
    name = "ddp_join"
    summary = ("rank r holds data for the first max(1, S - r) of S steps; all steps inside model.join(), "
               "K micro-batches per step (no_sync() on all but the last); ranks out of data shadow: exact")

    def dealt(self, batch: Batch, step: int, steps: int) -> Batch | None:
        """This rank's contiguous part of global batch ``step`` among the ranks still holding data, or None."""
        rank, holding = dist.get_rank(), holders(step, steps, dist.get_world_size())
        if rank >= holding:
            return None
        return Batch(batch.inputs.tensor_split(holding)[rank], batch.targets.tensor_split(holding)[rank], batch.count)

    def rank_part(self, objective, batch, mine=None):
        """A micro-batch's loss sum times the *initial* world size over the global batch's items (``mine``, this
        rank's part, is not needed): joined ranks add zero buckets and DDP still divides by the initial world size."""
        return super().rank_part(objective, batch)

    def context(self, model):
        return model.join()

    def train(self, model, optimizer, batches, objective):
        shares = []
        with self.context(model):
            for step, batch in enumerate(batches):
                mine = self.dealt(batch, step, len(batches))
                if mine is None:  # out of data: leave the loop; join shadows the others' collectives
                    break
                total = backward_chunks(objective.forward_of(model), mine.inputs, mine.targets, self.chunks,
                                        self.rank_part(objective, batch, mine), objective=objective,
                                        around=lambda last: self.sync_context(model, last))
                finish_step(optimizer, objective)
                shares.append(total / self.world_size)
        return shares + [0.0] * (len(batches) - len(shares))  # a rank's share of a batch it did not hold


@dataclasses.dataclass(frozen=True)
class DdpUnevenWithoutJoin(DdpJoin):
    name = "ddp_uneven_without_join"
    summary = "PITFALL: ddp_join's uneven steps without model.join(): rank 0 waits in an all-reduce nobody joins (a hang)"
    pitfall = Pitfall("uneven inputs across DDP ranks without join", twin="ddp_join")
    trap = ("hangs by design: a rank out of data leaves its loop while rank 0 waits in the last step's all-reduce; "
            "equivcheck reports the hang as an error after the job timeout (ec.check(..., timeout=...))")

    def context(self, model):
        return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class DdpJoinRankMean(DdpJoin):
    name = "ddp_join_rank_mean"
    summary = ("PITFALL: ddp_join with each rank's loss normalised by its own items (its mean): joined ranks add "
               "zeros and DDP averages equally, so a step a rank sits out counts half")
    pitfall = Pitfall("per-rank mean loss under DDP (token or shard imbalance)", twin="ddp_join")

    def rank_part(self, objective, batch, mine=None):
        own = mine or batch
        return lambda output, targets: objective.share(output, targets, own)
