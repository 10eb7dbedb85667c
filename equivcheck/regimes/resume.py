"""Resuming from a checkpoint: a regime trains ``at`` global batches, saves a checkpoint, and its processes end; fresh
processes build the model anew (a forgotten load shows), restore the checkpoint on the same regime or another (a
world size or a mesh of its own: ``fsdp:world_size=4>resume:at=2>fsdp:world_size=2``), and train to the end. The
two segments make one run, compared with the uninterrupted reference like any other: every gradient, the losses, the
final weights.

What a restart loses is lost: each segment is a fresh set of processes (:mod:`equivcheck.runners.resume`), so the
random streams, an optimizer's lazily created state, a GradScaler's scale and the data position survive only through
the checkpoint. The checkpoint is what a careful team writes (:mod:`equivcheck.runners.checkpoints`): the model and the
optimizer through ``torch.distributed.checkpoint`` (which reshards them onto the ranks that load), each rank's random
state, the GradScaler's state, the case's learning-rate scheduler, and the position, read as the next global batch. Each pitfall leaves one part out.

A save always falls between two optimizer steps: ``at`` counts global batches, and every regime here finishes its
accumulation cycle within one, so a save inside a cycle is refused by construction (a team's own checkpoint code, which
may save anywhere, is checked through its own step).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..case import Case
from ..device import DEFAULT_DEVICE, RankPlacement, place_ranks
from ..errors import InvalidArgument, expect_int
from ..precision import Precision, Tolerance
from .base import Pitfall, Regime
from .local import FullBatch
from .zero import Zero

# What a faithful checkpoint holds, each part a restart would otherwise lose.
PARTS = ("model", "optimizer", "scheduler", "rng", "scaler", "position")
RANK_ZERO_OPTIMIZER = "optimizer of rank 0"  # a pitfall's part: rank 0's optimizer state, loaded on every rank

# What a resume cannot join, and why: each segment starts in processes of its own, which import its code by name.
NOT_RESUMABLE = {
    "step": "a team's step given in process crosses to no other process: check_step(..., world_size=1) runs it on "
            "a rank, which imports it by name",
    "loop": "a team's loop given in process crosses to no other process: check_loop(..., world_size=1) runs it on "
            "a rank, which imports it by name",
}

OPTIMIZER_NOT_SAVED = "optimizer state not saved in a checkpoint"
RNG_NOT_RESTORED = "random state not restored on resume"
POSITION_RESET = "data position reset on resume"
SCALER_NOT_SAVED = "GradScaler state not saved in a checkpoint"
SCHEDULER_NOT_SAVED = "learning-rate scheduler not saved in a checkpoint"
SHARD_STATE_LOST = "a sharded optimizer's state restored from one rank's shard"


@dataclasses.dataclass(frozen=True)
class Resume(Regime):
    name = "resume"
    summary = ("BEFORE trains the first global batches (at: how many) and saves a checkpoint; fresh processes build the model anew, "
               "restore it on AFTER (default: BEFORE) and train to the end: 'ddp:world_size=4>resume:at=2>"
               "ddp:world_size=2'")
    distributed = True  # each segment trains in processes of its own (runners/resume.py), never in this one
    between = True
    saves: ClassVar[tuple[str, ...]] = PARTS  # what this regime's checkpoint holds

    at: int = dataclasses.field(metadata={"example": 1})  # global batches trained before the save
    save: str = ""  # a team's own save(model, optimizer, folder), by import path; "" (with load): the careful one here
    load: str = ""  # a team's own load(model, optimizer, folder), by import path
    before: Regime = dataclasses.field(default=FullBatch(), metadata={"joined": True})
    after: Regime | None = dataclasses.field(default=None, metadata={"joined": True})  # None: ``before`` again

    def __post_init__(self) -> None:
        expect_int("at", self.at)
        if bool(self.save) != bool(self.load):
            given, missing = ("save", "load") if self.save else ("load", "save")
            raise InvalidArgument(f"{given}={getattr(self, given)!r} is not allowed without {missing}=: expected both "
                                  "(a team's own checkpoint code, by import path) or neither")
        if isinstance(self.before, Resume) and self.at <= self.before.at:  # a resume after another: a later save
            raise InvalidArgument.value("at", self.at, f"more than the save before it (at={self.before.at}): a resume "
                                        "after another saves later")
        for regime in (None if isinstance(self.before, Resume) else self.before, self.after):
            if regime is not None and (regime.between or regime.name in NOT_RESUMABLE):
                raise InvalidArgument(f"regime spec {str(self)!r}: {str(regime)!r} cannot be resumed: "
                                      f"{NOT_RESUMABLE.get(regime.name, 'a resume joins two regimes that train')}")

    def __str__(self) -> str:
        core = super().__str__()
        return ">".join([*([str(self.before)] if self.before != FullBatch() else []), core,
                         *([str(self.after)] if self.after is not None else [])])

    @property
    def joins(self) -> tuple[Regime, Regime | None]:
        return self.before, self.after

    def joined(self, before: Regime | None, after: Regime | None) -> Resume:
        """Between ``before`` (a regime, or a resume before this one: a run restarted twice) and ``after``."""
        before = before or FullBatch()
        previous = before.segments[-1] if isinstance(before, Resume) else before
        return dataclasses.replace(self, before=before, after=None if after == previous else after)

    @property
    def links(self) -> tuple[Resume, ...]:
        """Every save of the run, in turn: this one, after those of a resume before it."""
        return (*self.before.links, self) if isinstance(self.before, Resume) else (self,)

    @property
    def segments(self) -> tuple[Regime, ...]:
        """The regime each segment trains under, in turn: one more than the saves."""
        first = self.links[0].before
        regimes = [first]
        for link in self.links:
            regimes.append(link.after or regimes[-1])
        return tuple(regimes)

    @property
    def world_size(self) -> int:  # the most ranks one segment holds at a time
        return max(regime.world_size for regime in self.segments)

    def validate(self, case: Case) -> None:
        for regime in self.segments:
            regime.validate(case)
        for before, after in zip(self.segments, self.segments[1:]):
            if isinstance(after, Zero) and not isinstance(before, Zero) and "optimizer" in self.saves:
                raise InvalidArgument(f"regime {str(self)!r}: {str(after)!r} cannot restore the optimizer state "
                                      f"{str(before)!r} saves through torch.distributed.checkpoint, whose helpers do "
                                      "not take a ZeroRedundancyOptimizer: expected ZeRO before the resume too")
        batches = case.steps * case.epochs
        if not 1 <= self.links[0].at or not self.at < batches:
            raise InvalidArgument(f"regime {str(self)!r} on case {case.name!r}: at={self.at} is not allowed: expected "
                                  f"1 to {batches - 1}, a save between two of the case's {batches} global batches")

    def micro_batches(self, case: Case) -> int:
        return max(regime.micro_batches(case) for regime in self.segments)

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        return next(filter(None, (regime.unavailable(device) for regime in self.segments)), None)

    def unavailable_in(self, precision: Precision, device: str = DEFAULT_DEVICE) -> str | None:
        return next(filter(None, (regime.unavailable_in(precision, device) for regime in self.segments)), None)

    def placement(self, device: str) -> RankPlacement:
        """Where each segment's processes train: a distributed regime's ranks, else one rank of its own."""
        return self.segment_placement(self.before, device)

    @staticmethod
    def segment_placement(regime: Regime, device: str) -> RankPlacement:
        return regime.placement(device) if regime.distributed else place_ranks(1, device, "auto")

    def device(self, asked: str = DEFAULT_DEVICE) -> torch.device:
        return self.before.device(asked)

    def tolerance_for(self, case: Case, precision: Precision, base: Tolerance) -> Tolerance | None:
        """A lossy segment's own bound, where one has it (a compressing DDP hook)."""
        return next(filter(None, (regime.tolerance_for(case, precision, base) for regime in self.segments)), None)


@dataclasses.dataclass(frozen=True)
class ResumeWithoutOptimizer(Resume):
    name = "resume_without_optimizer"
    summary = ("PITFALL: the checkpoint holds the model but not the optimizer: the restored run steps a fresh "
               "optimizer, whose moments (and step count) start again")
    pitfall = Pitfall(OPTIMIZER_NOT_SAVED, twin="resume")
    saves = tuple(part for part in PARTS if part != "optimizer")


@dataclasses.dataclass(frozen=True)
class ResumeWithoutScheduler(Resume):
    name = "resume_without_scheduler"
    summary = ("PITFALL: the learning-rate scheduler is not saved: the restored run's schedule starts again from its "
               "first step's rate (a warmup run twice)")
    pitfall = Pitfall(SCHEDULER_NOT_SAVED, twin="resume")
    saves = tuple(part for part in PARTS if part != "scheduler")

    def validate(self, case: Case) -> None:
        super().validate(case)
        if case.scheduler is None:
            raise InvalidArgument(f"regime {str(self)!r} on case {case.name!r}: the case has no scheduler= to lose "
                                  "(a case with a learning-rate schedule shows this pitfall)")


@dataclasses.dataclass(frozen=True)
class ResumeWithoutRng(Resume):
    name = "resume_without_rng"
    summary = ("PITFALL: the random state is not restored: the fresh processes' dropout draws other masks from the "
               "resumed step on")
    pitfall = Pitfall(RNG_NOT_RESTORED, twin="resume")
    saves = tuple(part for part in PARTS if part != "rng")


@dataclasses.dataclass(frozen=True)
class ResumeFromTheStart(Resume):
    name = "resume_from_the_start"
    summary = ("PITFALL: the data position is not restored: the restored run takes the first global batches again "
               "(a sampler reset to epoch 0, a skip that never happened)")
    pitfall = Pitfall(POSITION_RESET, twin="resume")
    saves = tuple(part for part in PARTS if part != "position")


@dataclasses.dataclass(frozen=True)
class ResumeOptimizerOfRankZero(Resume):
    name = "resume_optimizer_of_rank_zero"
    summary = ("PITFALL: rank 0 saves its optimizer.state_dict() and every rank loads it: where the optimizer's state "
               "is sharded (FSDP2, ZeRO) every rank restores rank 0's shard, the other shards' state is lost")
    pitfall = Pitfall(SHARD_STATE_LOST, twin="resume")
    saves = tuple(part for part in PARTS if part != "optimizer") + (RANK_ZERO_OPTIMIZER,)


@dataclasses.dataclass(frozen=True)
class ResumeWithoutScaler(Resume):
    name = "resume_without_scaler"
    summary = ("PITFALL: the GradScaler's state is not saved: the restored run counts its clean steps towards the "
               "next growth from zero (and scales from the initial scale where it had backed off)")
    pitfall = Pitfall(SCALER_NOT_SAVED, twin="resume")
    saves = tuple(part for part in PARTS if part != "scaler")

    def unavailable_in(self, precision: Precision, device: str = DEFAULT_DEVICE) -> str | None:
        if not precision.grad_scaler:
            return (f"precision {precision.name!r} steps without a GradScaler (fp16-autocast steps with one): there "
                    "is no scaler state to lose")
        return super().unavailable_in(precision, device)

