"""Sensitivity audit: can this case catch what it is meant to catch?

A check that passes proves something only if the case could have failed. ``audit(case)`` runs every
applicable built-in pitfall regime against the case and reports, per class of bug, ``catches`` with
the greatest margin, or ``blind`` with the reason measured from the case itself (every micro-batch
holds the same number of items; the reference's gradient norm never reaches the clipping threshold),
or ``not applicable`` (the model has no BatchNorm). ``warn_blind_spots`` is its cheap half, run by
``check_step`` and ``check_loop``: only what the data shows, no training.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..case import Batch, Case
from ..judge.verdict import Outcome
from ..check import check
from ..runners.dispatch import run
from ..errors import BlindSpotWarning, InvalidArgument, RunDied, warn
from ..registry import importable_source, resolve_case
from ..regimes import Pitfall, chunk_pairs, parse_regime
from ..regimes.ddp import shard
from ..regimes.pitfalls import clipping_optimizer
from ..process.seeding import DEFAULT_SEED, seeded
from ..runners.train import load_batches
from ..regimes.resume import (OPTIMIZER_NOT_SAVED, POSITION_RESET, RNG_NOT_RESTORED, SCALER_NOT_SAVED,
                              SCHEDULER_NOT_SAVED, SHARD_STATE_LOST)
from ..regimes.experts import (AUX_OVER_DP, AUX_TIMES_WORLD, EXPERTS_AVERAGED, EXPERTS_CLIPPED_ON_THEIR_RANK,
                                EXPERTS_OVER_DP)
from ..regimes.pipeline import TIED_CLIPPED_PER_STAGE
from ..regimes.checkpoint import RECOMPUTATION_CUTS_OFF
from ..regimes.base import SCALED_TWICE
from ..regimes.packing import LABEL_ACROSS, POSITIONS_RUN_ON, ROW_MEAN
from ..regimes.pitfalls import TERMS_PER_MICRO_BATCH

MAX_CHUNKS = 8  # micro-batch counts tried: 2 .. 8 (and every divisor of the batch size, for equal micro-batches)
WORLD_SIZE = 2  # the DDP classes are audited on 2 ranks of the warm pool

# The classes of bug, as the findings name them and as each pitfall regime declares its own (Regime.pitfall.bug).
UNEVEN_MEAN = "micro-batch mean / K, uneven micro-batches"
TOKEN_NORMALISATION = "token normalisation across micro-batches"
RANK_MEAN = "per-rank mean loss under DDP (token or shard imbalance)"
SAMPLER_PAD = "sampler pads micro-batches by repeating samples"
SAMPLER_DROP = "sampler drops the remainder (drop_last)"
ZERO_GRAD_INSIDE = "zero_grad inside the accumulation loop"
STEP_PER_MICRO_BATCH = "optimizer.step per micro-batch"
UNSCALE_PER_MICRO_BATCH = "GradScaler unscale_ per micro-batch"
BATCHNORM = "BatchNorm statistics per micro-batch"
DROPOUT = "dropout masks drawn per micro-batch"
CLIPPING = "clipping per micro-batch"
EPOCH_END = "end of epoch: the last, smaller window"
GRADIENT_SCALE = "a constant gradient scale under a scale-free optimizer"
SCALE_FREE = 1e-3  # an update this near itself (relative) with every gradient tripled: the optimizer is scale-free
# The classes the audit probes on a case, in its findings' order.
PROBED = (UNEVEN_MEAN, TOKEN_NORMALISATION, RANK_MEAN, SAMPLER_PAD, SAMPLER_DROP, ZERO_GRAD_INSIDE,
          STEP_PER_MICRO_BATCH, UNSCALE_PER_MICRO_BATCH, BATCHNORM, DROPOUT, CLIPPING, EPOCH_END)
# Classes a pitfall regime may declare that the audit does not probe: whether a case shows them does not depend on
# its data (an exact count of syncs, a hang), or they need what only some cases give (several wrappers, a trunk that
# steps one token, pipeline stages).
NOT_PROBED = (
    "gradient sync on every micro-batch",
    "gradients never all-reduced",
    "uneven inputs across DDP ranks without join",
    "hidden state detached between per-token backwards (truncated BPTT)",
    "dropout masks redrawn in a recomputed forward",
    SCALED_TWICE, TERMS_PER_MICRO_BATCH, RECOMPUTATION_CUTS_OFF,
    "tensor-parallel ranks fed different batches",
    "loss scaled by the tensor-parallel size",
    "clipping by the norm of local shards under tensor parallelism",
    "clipping by a norm averaged over the ranks (FSDP2)",
    "clipping by a norm counting each replica's elements again (HSDP)",
    "sequence-parallel norm gradients not all-reduced over tensor parallelism",
    "dropout seeded per rank inside a tensor-parallel group",
    OPTIMIZER_NOT_SAVED, RNG_NOT_RESTORED, POSITION_RESET, SHARD_STATE_LOST, SCALER_NOT_SAVED, SCHEDULER_NOT_SAVED,
    AUX_OVER_DP, AUX_TIMES_WORLD, EXPERTS_AVERAGED, EXPERTS_OVER_DP, EXPERTS_CLIPPED_ON_THEIR_RANK,
    TIED_CLIPPED_PER_STAGE, POSITIONS_RUN_ON, LABEL_ACROSS, ROW_MEAN,
)
BUG_CLASSES = PROBED + NOT_PROBED


class Sensitivity(enum.Enum):
    CATCHES = "catches"
    BLIND = "blind"
    NOT_APPLICABLE = "not applicable"
    NOT_RUN = "not run"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One class of bug: whether the case shows it, and the evidence (a regime and its margin, or a reason)."""

    pitfall: str
    sensitivity: Sensitivity
    evidence: str
    regime: str | None = None
    margin: float | None = None


@dataclasses.dataclass(frozen=True)
class Audit:
    case: str
    findings: tuple[Finding, ...]

    @property
    def blind(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.sensitivity is Sensitivity.BLIND)

    def finding(self, pitfall: str) -> Finding:
        return next(f for f in self.findings if f.pitfall == pitfall)

    def describe(self) -> str:
        width = max(len(f.pitfall) for f in self.findings)
        lines = [f"audit of {self.case}: can it catch each class of bug?"]
        lines += [f"  {f.pitfall:<{width}}  {f.sensitivity.value:<14}  {f.evidence}" for f in self.findings]
        return "\n".join(lines)

    __str__ = describe  # print(ec.audit(case)) prints the table

    def to_rows(self) -> list[dict]:
        return [{"case": self.case, "pitfall": f.pitfall, "sensitivity": f.sensitivity.value,
                 "evidence": f.evidence, "regime": f.regime, "margin": f.margin} for f in self.findings]


# --- what the data shows, before anything trains ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """The case's global batches and their item counts, as the regimes will cut them."""

    case: Case
    batches: list[Batch]

    @classmethod
    def of(cls, case: Case, seed: int) -> Shape:
        with seeded(seed):
            return cls(case, load_batches(case))

    def items_per_sample(self) -> set[int]:
        return {int(self.case.items(b.targets[i : i + 1])) for b in self.batches for i in range(len(b))}

    def uneven_chunkings(self) -> list[int]:
        """Micro-batch counts that cut the global batch into micro-batches of different sizes."""
        return [k for k in range(2, min(self.case.batch_size, MAX_CHUNKS) + 1) if self.case.batch_size % k]

    def equal_chunkings(self) -> list[int]:
        """Micro-batch counts that cut the global batch into micro-batches of the same number of samples."""
        return [k for k in range(2, self.case.batch_size + 1) if self.case.batch_size % k == 0][:MAX_CHUNKS]

    def unequal_items(self, chunks: int) -> bool:
        return any(len({int(self.case.items(t)) for _, t in chunk_pairs(b, chunks)}) > 1 for b in self.batches)

    def shard_items(self, world_size: int) -> str:
        """The item counts of the ranks' shards, as one figure where every shard of every batch agrees."""
        counts = sorted({shard(b, r, world_size).items for b in self.batches for r in range(world_size)})
        return ", ".join(map(str, counts))


def _uniform_items_reason(shape: Shape) -> str | None:
    counts = shape.items_per_sample()
    if len(counts) == 1:
        return f"every sample holds the same number of items ({counts.pop()})"
    return None


def warn_blind_spots(case: Case | str, *, seed: int = DEFAULT_SEED, isolate: bool = False) -> None:
    """Warn where the case cannot show a bug a team's step could plausibly have: a normalisation bug
    when every sample holds the same number of items; a clipping bug when the declared ``max_norm``
    never engages in the reference (one full-batch run, only where clipping is declared, isolated as the
    check's runs are: a reference that dies is the check's error to report, not this warning's)."""
    case = resolve_case(case)
    reason = _uniform_items_reason(Shape.of(case, seed))
    if reason is not None:
        warn(BlindSpotWarning(
            f"case {case.name!r} cannot catch a per-micro-batch or per-rank mean (token normalisation): {reason}, "
            f"so a step that splits each batch of {case.batch_size} into equal micro-batches or shards averages "
            "exactly like full batch. Give samples different item counts (padding, masks) to catch it. A step "
            "that averages each micro-batch or shard over its own items (the mean loss of each, divided by K) then "
            "fails, and rightly: with uneven counts its mean is not the global batch's, as in training on padded or "
            "masked batches; such a step divides each micro-batch's summed loss by the global batch's item count "
            "instead. ec.audit(case) lists every class of bug the case can and cannot show"))
    if case.max_norm is not None:
        try:
            norms = [_norm(step) for step in run(case, "full_batch", seed=seed, isolate=isolate).grads]
        except RunDied:
            return
        if max(norms) < case.clipping_threshold(case.max_norm):
            warn(BlindSpotWarning(
                f"case {case.name!r} cannot catch a clipping bug: the reference's gradient norm (up to "
                f"{max(norms):.2g}) never reaches {_threshold_words(case)}, so clipping never engages. With no change "
                f"to the step: Case(..., clip_scale={engaging_scale(case, norms):.2g}) makes every clip_grad_norm_ of "
                "the check, the step's and the reference's, clip at that fraction of its threshold, which engages "
                "at every step here"))


# --- the audit: every applicable pitfall regime, run ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Probe:
    """A class of bug: the (pitfall spec, faithful twin spec) pairs that would show it on this case, or why
    none can. A pitfall is judged against its twin, not full batch: BatchNorm in the model must not make
    every accumulation pitfall look caught."""

    pitfall: str
    pairs: Sequence[tuple[str, str]]
    blind_reason: Callable[[], str]  # measured from the case: why no spec shows an effect
    not_applicable: str | None = None
    distributed: bool = False


def _probes(shape: Shape, model: nn.Module) -> list[Probe]:
    case, batch = shape.case, shape.case.batch_size
    uneven, equal = shape.uneven_chunkings(), shape.equal_chunkings()
    tried = lambda ks: ", ".join(map(str, ks)) or "none"  # noqa: E731
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    dropout = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    small = f"batch_size {batch} cannot be cut into micro-batches" if batch < 2 else None

    def tokens_reason() -> str:
        uniform = _uniform_items_reason(shape)
        if uniform:
            return uniform
        return f"micro-batches of equal size hold equal item counts for every K tried ({tried(equal)})"

    return [
        Probe(UNEVEN_MEAN, _against_twins_of(UNEVEN_MEAN, [f"naive_accumulate:chunks={k}" for k in uneven]),
              lambda: (f"every chunking tried splits batch_size {batch} evenly" if not uneven else
                       f"no uneven chunking tried (K = {tried(uneven)}) shows an effect"), small),
        Probe(TOKEN_NORMALISATION,
              _against_twins_of(TOKEN_NORMALISATION,
                                [f"naive_accumulate:chunks={k}" for k in equal if shape.unequal_items(k)]),
              tokens_reason, small),
        Probe(RANK_MEAN, _against_twins_of(RANK_MEAN, [f"ddp_mean_loss:world_size={WORLD_SIZE}"]),
              lambda: f"every rank's shard holds the same number of items ({shape.shard_items(WORLD_SIZE)}) on {WORLD_SIZE} ranks",
              f"batch_size {batch} cannot be sharded over {WORLD_SIZE} ranks" if batch < WORLD_SIZE else None, True),
        Probe(SAMPLER_PAD, _against_twins_of(SAMPLER_PAD, [f"sampler_pad:chunks={k}" for k in uneven]),
              lambda: f"every chunking tried splits batch_size {batch} evenly: nothing to pad", small),
        Probe(SAMPLER_DROP, _against_twins_of(SAMPLER_DROP, [f"sampler_drop:chunks={k}" for k in uneven]),
              lambda: f"every chunking tried splits batch_size {batch} evenly: nothing to drop", small),
        Probe(ZERO_GRAD_INSIDE, _against_twins_of(ZERO_GRAD_INSIDE, ["zero_grad_inside:chunks=2"]),
              lambda: "the last micro-batch's gradient alone equals the whole batch's here", small),
        Probe(STEP_PER_MICRO_BATCH, _against_twins_of(STEP_PER_MICRO_BATCH, ["step_per_micro_batch:chunks=2"]),
              lambda: "stepping per micro-batch leaves the weights where one step does here", small),
        Probe(UNSCALE_PER_MICRO_BATCH,
              _against_twins_of(UNSCALE_PER_MICRO_BATCH, ["scaler_unscale_per_micro_batch:chunks=2"]),
              lambda: "unscaling partial sums changes nothing measurable here", small),
        # No regime is a BatchNorm or dropout bug: faithful accumulation shows it, against full batch.
        Probe(BATCHNORM, [("accumulate:chunks=2", "full_batch")],
              lambda: f"BatchNorm ({', '.join(bn)}) sees the same statistics per micro-batch here",
              small or (None if bn else "the model has no BatchNorm")),
        Probe(DROPOUT, [("accumulate:chunks=2", "full_batch")],
              lambda: (f"dropout ({', '.join(dropout)}) draws each micro-batch's masks in the global batch's "
                       "order: one dropout layer on CPU"),
              small or (None if dropout else "the model has no active dropout")),
    ]


def _against_twins_of(bug: str, specs: Iterable[str]) -> list[tuple[str, str]]:
    """Each pitfall spec beside the faithful twin its regime declares; each regime must declare ``bug``."""
    return [(spec, str(_declared(spec, bug).twin_of(spec))) for spec in specs]


def _declared(spec: str, bug: str) -> Pitfall:
    declared = type(parse_regime(spec)).pitfall
    if not isinstance(declared, Pitfall) or bug not in declared.bugs:
        raise RuntimeError(f"the audit probes {bug!r} with {spec!r}, whose regime declares {declared!r}: expected "
                           f"Pitfall({bug!r}, ...) on its class")
    return declared


def audit(case: Case | str, *, seed: int = DEFAULT_SEED, timeout: float | None = None, isolate: bool = False,
          device: str | None = None) -> Audit:
    """Run every applicable built-in pitfall regime on ``case`` and say, per class of bug, whether the
    case catches it (with the greatest margin) or is blind to it (with the reason measured from it).
    ``isolate`` and ``device``: as for :func:`check` (the runs train in a forked child; on that device)."""
    case = resolve_case(case)
    shape = Shape.of(case, seed)
    with seeded(seed):
        model = case.model()
    probes = _probes(shape, model)
    registered = _crosses_to_ranks(case)
    options = {"seed": seed, "isolate": isolate, "device": device} | ({"timeout": timeout} if timeout is not None else {})
    wanted = {pair for p in probes if p.not_applicable is None and (registered or not p.distributed) for pair in p.pairs}
    outcomes = _against_twins(case, wanted, options)
    findings = [_finding(p, outcomes, registered) for p in probes]
    findings.append(_clipping(case, options))
    findings.append(_epoch_end(case))
    scale_free = _scale_free(case, seed)
    return Audit(case.name, tuple(findings) + ((scale_free,) if scale_free is not None else ()))


def _against_twins(case: Case, pairs: Iterable[tuple[str, str]], options: dict) -> dict[tuple[str, str], Outcome]:
    """Each pitfall checked against its twin: one check per twin, the twin run as the reference."""
    by_twin: dict[str, list[str]] = {}
    for pitfall, twin in sorted(pairs):
        by_twin.setdefault(twin, []).append(pitfall)
    return {(o.regime, twin): o for twin, pitfalls in by_twin.items()
            for o in check(case, pitfalls, reference=twin, **options).outcomes}


def _crosses_to_ranks(case: Case) -> bool:
    """Whether DDP ranks can import ``case``: registered, or bound to a name at a module's top level."""
    try:
        importable_source(case)
    except InvalidArgument:
        return False
    return True


def _finding(probe: Probe, outcomes: dict[tuple[str, str], Outcome], registered: bool) -> Finding:
    if probe.not_applicable is not None:
        return Finding(probe.pitfall, Sensitivity.NOT_APPLICABLE, probe.not_applicable)
    if probe.distributed and not registered:
        return Finding(probe.pitfall, Sensitivity.NOT_RUN,
                       "DDP ranks import a case by the name it is bound to at a module's top level (CASE = "
                       "ec.Case(...)), registered or not, and this one is bound to none")
    if not probe.pairs:
        return Finding(probe.pitfall, Sensitivity.BLIND, probe.blind_reason())
    return _strongest(probe.pitfall, [outcomes[pair] for pair in probe.pairs], probe.blind_reason)


def _strongest(pitfall: str, outcomes: Iterable[Outcome], blind_reason: Callable[[], str]) -> Finding:
    """The outcome with the greatest margin decides: above 1 the case catches the class."""
    outcomes = list(outcomes)
    measured = [o for o in outcomes if o.comparison is not None]
    if not measured:
        first = outcomes[0]
        return Finding(pitfall, Sensitivity.NOT_RUN, f"{first.regime}: {first.verdict.value}: {first.reason}")
    best = max(measured, key=lambda o: o.comparison.margin)
    margin = best.comparison.margin
    if not best.comparison.ok:
        return Finding(pitfall, Sensitivity.CATCHES, f"{best.regime}: margin {margin:.2g}", best.regime, margin)
    return Finding(pitfall, Sensitivity.BLIND, f"{blind_reason()} (greatest margin {margin:.2g})", best.regime, margin)


def _epoch_end(case: Case) -> Finding:
    """The end-of-epoch bugs (the last, smaller window still divided by K; a tail never stepped; its gradients
    leaking into the next epoch) live in a team's loop: no built-in regime has them, but a case can only show
    them with a smaller last batch, or more than one epoch."""
    pitfall = EPOCH_END
    if case.last_batch == "exact" and case.epochs == 1:
        return Finding(pitfall, Sensitivity.BLIND, "every global batch is full and there is one epoch: declare "
                       "last_batch='keep' with a remainder (and epochs=2 for gradients leaking across epochs)")
    return Finding(pitfall, Sensitivity.NOT_RUN, f"the case has {'a smaller last batch' if case.last_batch == 'keep' else 'full batches'} "
                   f"over {case.epochs} epoch(s): the bugs live in a team's loop, so check that loop with check_loop")


def _scale_free(case: Case, seed: int) -> Finding | None:
    """Where the case's optimizer makes about the same update of every gradient tripled (Muon's orthogonalisation,
    Adam's normalisation, a sign-based one): a gradient scaled by a constant (a missing / K) hardly moves the weights,
    and the gradients show it. Measured on one step from the model's first weights, by 3 (a power of two scales a
    float exactly, and would hide the rounding through which a low-precision update, as torch's Muon's bfloat16
    Newton-Schulz, shows it); None where the update grows with the gradient or its rounding shows the scale."""
    with seeded(seed):
        model = case.model()
        gradients = [torch.randn_like(p) for p in model.parameters()]
    updates = []
    try:
        for scale in (1.0, 3.0):
            stepped = copy.deepcopy(model)
            optimizer = case.build_optimizer(stepped)
            for parameter, gradient in zip(stepped.parameters(), gradients):
                parameter.grad = gradient * scale
            optimizer.step()
            updates.append(torch.cat([(after.detach() - before.detach()).reshape(-1)
                                      for after, before in zip(stepped.parameters(), model.parameters())]))
    except Exception as error:  # noqa: BLE001 - the rest of the audit stands
        return Finding(GRADIENT_SCALE, Sensitivity.NOT_RUN, f"one step of the case's optimizer on gradients of its "
                       f"own failed: {type(error).__name__}: {error}")
    moved = float(updates[0].abs().max())
    apart = float((updates[1] - updates[0]).abs().max()) / moved if moved else 0.0
    if apart > SCALE_FREE:
        return None
    return Finding(GRADIENT_SCALE, Sensitivity.CATCHES, (
        f"{type(optimizer).__name__} makes the same update of every gradient tripled "
        f"(measured: {apart:.2g} apart, relative, in one step): the weights hardly show a constant scale (a missing / "
        "K), the gradients do, and equivcheck compares both at every step"))


def engaging_scale(case: Case, norms: list[float]) -> float:
    """A ``clip_scale`` that puts the threshold at half the reference's least gradient norm: clipping at every step."""
    return min(norms) / 2 / case.max_norm


def _threshold_words(case: Case) -> str:
    scaled = f" x clip_scale {case.clip_scale:g}" if case.clip_scale is not None else ""
    return f"max_norm ({case.max_norm:g}{scaled})"


def _clipping(case: Case, options: dict) -> Finding:
    """Clipping per micro-batch shows only where the clipping threshold engages: the reference's gradient
    norm must reach ``case.max_norm`` at some step."""
    pitfall = CLIPPING
    if case.max_norm is None:
        return Finding(pitfall, Sensitivity.NOT_APPLICABLE,
                       "no clipping declared: give Case(max_norm=M) if the code checked clips gradients")
    if case.batch_size < 2:
        return Finding(pitfall, Sensitivity.NOT_APPLICABLE, f"batch_size {case.batch_size} cannot be cut into micro-batches")
    clipped = dataclasses.replace(case, name=f"{case.name}_clipped", optimizer=clipping_optimizer(case.max_norm, case.optimizer),
                                  expect_mismatch={})
    spec = f"clip_per_micro_batch:chunks=2,max_norm={case.max_norm:g}"
    (outcome,) = check(clipped, [spec], reference=str(_declared(spec, pitfall).twin_of(spec)), **options).outcomes
    if outcome.comparison is None:  # the check could not run (an error, a skip): its outcome says why
        return _strongest(pitfall, [outcome], lambda: "")
    norms = [_norm(step) for step in run(case, "full_batch", **options).grads]  # unclipped: what clipping meets

    def reason() -> str:
        if max(norms) < case.clipping_threshold(case.max_norm):
            return (f"the reference's gradient norm (up to {max(norms):.2g}) never reaches {_threshold_words(case)}: "
                    f"Case(..., clip_scale={engaging_scale(case, norms):.2g}) engages it with no change to the step")
        return "clipping each half of the batch changes nothing measurable"

    return _strongest(pitfall, [outcome], reason)


def _norm(gradients: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in gradients.values()])))
