"""One run's arguments, checked once: a :class:`RunRequest` is made by :meth:`RunRequest.of` (or by a check's plan,
which has checked them for all its runs) and trusted from then on, here, in a forked child and on ranks, where it
crosses as plain data (:meth:`RunRequest.plain`, :meth:`RunRequest.from_plain`)."""

from __future__ import annotations

import dataclasses

import torch

from ..case import Case
from ..device import DEFAULT_DEVICE, device_for
from ..errors import InvalidArgument, expect_int, expect_seed
from ..precision import Precision, registered_name, resolve_precision
from ..process import threads as intra_op
from ..process.seeding import DEFAULT_SEED
from ..regimes import Regime, parse_regime
from ..registry import resolve_case
from ..judge import witness

# A global batch's samples as given, or reordered, or as given with the backward at another scale (each a witness)
SAMPLE_ORDERS = ("given", *witness.ORDERS, *witness.RESCALED)


@dataclasses.dataclass(frozen=True)
class Checkpointed:
    """One save of a resumed run: the ``parts`` its checkpoint holds, in ``folder``; or a team's own ``save`` and
    ``load`` (by import path) in their place."""

    folder: str
    parts: tuple[str, ...]
    save: str = ""
    load: str = ""


@dataclasses.dataclass(frozen=True)
class Restart:
    """A resume's segment (equivcheck.regimes.resume): global batches ``start`` to ``stop`` (None: the last), restored
    from ``load_from`` where a save came before it (on a model built anew) and saved to ``save_to`` where one comes
    after it. A segment restored without the position trains the first batches again."""

    start: int
    stop: int | None
    load_from: Checkpointed | None = None
    save_to: Checkpointed | None = None
    whole_source: bool = False  # a team's loop: handed every batch to its stop, it skips the trained ones itself

    def batches(self, batches: list) -> list:
        stop = len(batches) if self.stop is None else self.stop
        if self.load_from is None:
            return batches[:stop]
        if self.whole_source:  # the same batch source as the uninterrupted run: the loop's own position decides
            return ResumedSource(batches[:stop], self.start)
        return batches[self.start : stop] if "position" in self.load_from.parts else batches[: stop - self.start]


class ResumedSource(list):
    """Every global batch, handed to a team's resumed loop, which must skip the ``trained_from`` it trained before
    the restart by its own restored state; the harness reads ``trained_from`` only to know how many losses to expect
    where the loop reports none."""

    def __init__(self, batches: list, trained_from: int) -> None:
        super().__init__(batches)
        self.trained_from = trained_from


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """Train ``case`` for its steps under ``regime`` in ``precision`` on ``device`` from ``seed``: with its peak
    activation memory where ``measure_memory``, on ``threads`` intra-op threads, each global batch's samples in
    ``order``."""

    case: Case
    regime: Regime
    precision: Precision
    seed: int = DEFAULT_SEED
    measure_memory: bool = True
    threads: int = 1
    order: str = "given"
    device: str = DEFAULT_DEVICE
    restart: Restart | None = None  # a resume's segment (runners/resume.py): set there, never by a caller
    wide_threads: int = 1  # where nobody chose: what a large model in this process trains on (process/threads.py)
    trace_steps: tuple[int, ...] = ()  # a failed check's replay: these optimizer steps traced, the run stopped after
    trace_modules: bool = True  # and its modules' calls recorded (False: its parameters' gradients alone)
    # the replay as its eager twin: torch.compile's code left uncompiled (True: dynamo off), or only these modules'
    # forwards (by their names in the case's model) run uncompiled inside the compiled code
    trace_eager: bool | tuple[str, ...] = False
    anchor_to: str = ""  # a folder: the state each step starts from saved there, for runs anchored to it (anchors.py)

    @classmethod
    def of(cls, case: Case | str, regime: Regime | str, *, seed: int = DEFAULT_SEED,
           dtype: str | torch.dtype | Precision | None = None, measure_memory: bool = True, threads: int | None = None,
           order: str = "given", device: str | torch.device | None = None) -> RunRequest:
        """Every argument checked, every usage error raised here; the thread count resolved where the caller's
        choice is visible (ranks and children train with it)."""
        case, regime = resolve_case(case), parse_regime(regime)
        expect_seed(seed)
        if threads is not None:
            expect_int("threads", threads)
        if order not in SAMPLE_ORDERS:
            raise InvalidArgument.value("order", order, " or ".join(map(repr, SAMPLE_ORDERS)))
        regime.validate(case)
        precision = resolve_precision(dtype, default=case.dtype)
        if regime.distributed:
            registered_name(precision)  # only registered modes cross to ranks
        device = device_for(device, precision.default_device)
        return cls(case, regime, precision, seed, measure_memory, intra_op.resolve(threads), order, device,
                   wide_threads=intra_op.wide(threads))

    def settings(self) -> dict:
        """Everything but the case and the regime, which a forked child holds already (it is found by its place)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name not in ("case", "regime")}

    def plain(self) -> dict:
        """:meth:`settings` as plain data for ranks: the precision by its registered name."""
        return {**self.settings(), "precision": registered_name(self.precision)}

    @classmethod
    def rebuilt(cls, case: Case, regime: Regime, settings: dict) -> RunRequest:
        """The request :meth:`settings` or :meth:`plain` describes, for ``case`` and ``regime`` found again in
        another process: trusted, not checked again."""
        precision = settings["precision"]
        return cls(case, regime, **{**settings, "precision": resolve_precision(precision) if isinstance(precision, str)
                                    else precision})
