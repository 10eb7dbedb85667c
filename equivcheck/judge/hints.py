"""Diagnosis: one line naming the likely pitfall behind a pattern of mismatches.

Each known pitfall leaves a recognisable trace in what differs first: ranks whose gradients differ
when their optimizers step (gradients never all-reduced), the step count (stepping per
micro-batch), one factor across every gradient (loss scaling), the running statistics (BatchNorm),
the step-0 loss (a forward that differs: dropout masks, batch statistics, mean / K), gradients of the
early layers only (a cut backward: a detached hidden state), or every gradient while the loss is
equal (the sum of micro-batch gradients altered: zero_grad, clipping or unscaling per micro-batch).
The rules run in that order and the first that fits speaks; a hint says "likely", never "is".
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..diff import COMPUTED_IN, SCALER_PREFIX, Comparison, Mismatch, ProblemKind, as_real
from ..result import RunResult

class Hint(str):
    """A hint's text, with the phases of a step (diff.PHASES) where the pitfalls it names would make a run part first,
    whether they act between modules (a regime's loop, never a module's own code) and whether they need an
    accumulation loop (``micro_batches``: more than one forward a step); a hint that a run's
    :class:`~equivcheck.diff.Location` contradicts is dropped (:func:`agreeing`). A ``str``, so that it reads and
    prints as hints always have; () phases: it agrees with any location."""

    phases: tuple[str, ...]
    between_modules: bool
    micro_batches: bool

    def __new__(cls, phases: tuple[str, ...], text: str, between_modules: bool = False,
                micro_batches: bool = False) -> Hint:
        hint = super().__new__(cls, text)
        hint.phases, hint.between_modules, hint.micro_batches = phases, between_modules, micro_batches
        return hint

    def __getnewargs__(self) -> tuple[tuple[str, ...], str, bool, bool]:  # pickled across processes with its phases
        return (self.phases, str(self), self.between_modules, self.micro_batches)


def agreeing(comparison: Comparison) -> Comparison:
    """``comparison`` with its hint dropped where the run was found to part in another phase than the pitfalls it
    names, in a module's own code where they act between modules, or in a step that called the model once where they
    need an accumulation loop: a located run never reads a hint that contradicts its location. An optimizer location on a
    parameter stepped shard by shard gets the hint its location tells (:data:`SHARDED_UPDATE`)."""
    location, hint = comparison.location, comparison.hint
    phases = getattr(hint, "phases", ())
    if location is not None and location.phase == "optimizer" and location.in_shards:
        return dataclasses.replace(comparison, hint=SHARDED_UPDATE)  # what the location alone tells
    if location is None or not hint:
        return comparison
    # the run's precision is the whole finding; a difference under the verdict's tolerance is not what the hints'
    # rules read (they read what fails the verdict, later): no pitfall is hinted
    if location.tensor == COMPUTED_IN or location.below_tolerance:
        return dataclasses.replace(comparison, hint="")
    if not phases:
        return comparison
    if location.phase in phases and not (location.own_code and hint.between_modules) \
            and not (hint.micro_batches and location.forwards == 1):
        return comparison
    return dataclasses.replace(comparison, hint="")


# What an optimizer location on a parameter stepped shard by shard says: the update read the shard for the matrix
SHARDED_UPDATE = Hint(("optimizer",), (
    "every gradient the optimizer read matches and the update does not, on a parameter each rank stepped its shard of: "
    "likely an optimizer whose update reads the whole matrix (Muon's Newton-Schulz, Shampoo's or SOAP's "
    "preconditioners, a norm or a learning-rate scale of the matrix's shape) computing it from each rank's shard; "
    "gather each matrix for its update (as distributed Muon does), or shard the optimizer by whole parameters "
    "(ZeRO's partitions)"))

# The buffers a BatchNorm layer keeps: a difference in them is one of batch statistics
BATCH_STATISTICS = frozenset({"running_mean", "running_var", "num_batches_tracked"})

# A common factor must explain every gradient to this relative residual to count as "one factor".
FACTOR_RESIDUAL = 1e-3


def diagnose(reference: RunResult, candidate: RunResult, comparison: Comparison) -> Comparison:
    """``comparison`` with its hint: kept where one is set already (the float64 shadows' of a low-precision
    run speak first), else the first rule's that fits a failed comparison, else none."""
    if comparison.ok or comparison.hint:
        return comparison
    shapes = [p for p in comparison.problems if getattr(p, "kind", None) is ProblemKind.SHAPE]
    hint = _shapes_hint(shapes) if shapes else _hint(reference, candidate, comparison.mismatches,
                                                      comparison.tolerance.atol)
    return dataclasses.replace(comparison, hint=hint)


def _shapes_hint(shapes: list) -> str:
    """Tensors of another shape than the reference's are no numbers to weigh: the parameter was read back as a part."""
    return (f"{len(shapes)} tensor{'s' * (len(shapes) > 1)} came back in another shape than the reference's (first: "
            f"{shapes[0]}): likely a shard read back as it is (a team's own layers: give gather=), or layers the "
            "parallelize made that the case's model does not name alike")


def _over_tp(run: RunResult) -> bool:
    """Whether the run communicated over a tensor-parallel mesh dimension (``"all_reduce[tp]"``)."""
    return _over(run, "tp")


def _over(run: RunResult, dimension: str) -> bool:
    """Whether the run communicated over the mesh dimension ``dimension`` (``"send[pp]"``)."""
    return any(kind.endswith(f"[{dimension}]") for step in run.collectives or () for kind in step)


def _hint(reference: RunResult, candidate: RunResult, mismatches: tuple[Mismatch, ...], atol: float) -> str:
    """The one line for a comparison that failed, or "" where no rule fits."""
    first_grads = {m.name for m in mismatches if m.kind == "grad" and m.first_step == 0}
    unsynchronised = unsynchronised_ranks(candidate, atol)
    if unsynchronised is not None:
        step, ranks, spread = unsynchronised
        some = (f" (at step 0 only {', '.join(sorted(first_grads))} differ from the reference's)"
                if first_grads and len(first_grads) < len(reference.grads[0]) else "")
        over_tp = _over_tp(candidate)
        likely = ("a tensor-parallel group's ranks computing what they hold alike differently (other batches, other "
                  "dropout masks), or a replicated gradient not all-reduced over tp (a sequence-parallel norm's)"
                  if over_tp else
                  "a module reached around its DDP wrapper (model.module), a backward() inside the wrapped module's "
                  "own forward, or no_sync() still on for the last micro-batch")
        if reference.grad_norms and candidate.grad_norms:  # both clip: a norm each rank computed alone scales apart
            likely = ("each rank clipping by a norm of its own (its own shards or experts alone, never summed over "
                      f"the ranks), or {likely}")
        # a TP group computing alike differently parts in the forward (or in the random stream its masks are drawn
        # from); a reduction missed, after backward
        phases = ("forward", "state", "communication", "gradient") if over_tp else ("communication", "gradient")
        return Hint(phases, f"gradients were not all-reduced: at step {step} rank{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))} held gradients up to {spread:.3g} away from rank 0's when the "
                    f"optimizer stepped{some}; likely {likely}")
    kinds = {m.kind for m in mismatches}
    loss_first = next((m.first_step for m in mismatches if m.kind == "loss"), None)

    if reference.optimizer_steps != candidate.optimizer_steps:
        return Hint(("optimizer",),
                _step_count(reference.optimizer_steps, candidate.optimizer_steps, candidate.steps_per_batch))
    if kinds == {"loss"}:
        return Hint(("loss",),
                "only the reported losses differ; every gradient and weight matches: the step likely returns a logged "
                "or approximate loss (say the last micro-batch's loss x K) instead of the global batch's mean; "
                "return that mean or None, or check with compare_losses=False")
    factor = common_factor(reference, candidate) if first_grads else None
    if factor is not None and _over_tp(candidate) and _whole_ratio(factor):
        pipeline = (", or on this pipeline by its micro-batch count twice (a mean loss divided by K while the "
                    "schedule's scale_grads divides again)") if _over(candidate, "pp") else ""
        return Hint(("loss", "communication", "gradient"),
                f"every gradient is {factor:.6g} x the reference's from step 0 on a tensor-parallel mesh: likely the "
                f"loss divided by the TP size (each TP rank counted as a data-parallel one){pipeline}" if factor < 1 else
                f"every gradient is {factor:.6g} x the reference's from step 0 on a tensor-parallel mesh: likely the "
                "loss summed over the TP ranks, each of which computes the whole loss")
    if factor is not None and reference.grad_norms and candidate.grad_norms:  # both clip, and by other factors
        return Hint(("loss", "gradient"),
                f"every gradient is {factor:.6g} x the reference's from step 0, and both runs clip: likely the "
                "clipping norm computed otherwise than the whole gradient's (a mean of the ranks' norms, each "
                "replica's or tied copy's elements counted again, a rank's own shards alone), or loss scaling "
                "(sum vs mean, a missing or extra / K)")
    if factor is not None:
        clipping = (", or gradient clipping that engages in only one of the two (clip_grad_norm_ scales every "
                    "gradient by one factor below 1): give the reference the same clipping"
                    + _clipped_at(candidate)) if factor < 1 else ""
        return Hint(("loss", "gradient"),
                f"every gradient is {factor:.6g} x the reference's from step 0: likely loss scaling "
                f"(sum vs mean, a missing or extra / K, or gradients left scaled by a GradScaler){clipping}")
    if "buffer" in kinds and all(m.name.startswith(SCALER_PREFIX) for m in mismatches if m.kind == "buffer"):
        names = ", ".join(sorted(m.name for m in mismatches if m.kind == "buffer"))
        return Hint(("state",),
                f"the GradScaler's state differs ({names}): likely a resume that did not save or restore it, or "
                "scaler.update() called more or less often than once per optimizer step")
    if "buffer" in kinds:
        names = sorted(m.name for m in mismatches if m.kind == "buffer")
        if any(name.rpartition(".")[2] in BATCH_STATISTICS for name in names):
            return Hint(("forward", "state"),
                        f"running statistics differ ({few(names)}): likely BatchNorm seeing other batch statistics "
                        "per micro-batch or rank; use a layer without batch statistics, or SyncBatchNorm under DDP")
        return Hint(("forward", "state"),
                    f"buffers of the model's own differ ({few(names)}): likely updated from a micro-batch's or a "
                    "rank's counts alone (a router's load or bias), or carried otherwise between steps (a resume "
                    "whose checkpoint left them out, code that resets them)")
    if loss_first == 0 and _over_tp(candidate):  # dropout masks drawn otherwise: the random stream (``state``)
        return Hint(("forward", "loss", "state"),
                "the step-0 loss already differs though every run starts from the same weights, on a tensor-parallel "
                "mesh: the forward differs; likely a bias or another replicated term added on every TP rank before "
                "the reduce (counted TP times), the TP ranks handed other batches or other dropout masks")
    if loss_first == 0:
        return Hint(("forward", "loss", "state"),
                "the step-0 loss already differs though every run starts from the same weights: the forward or the "
                "loss weighting differs; likely micro-batch mean / K with uneven chunks or token counts, dropout "
                "masks drawn differently per micro-batch, or batch statistics")
    tp_rule = _tensor_parallel(reference, candidate, first_grads) if _over_tp(candidate) else ""
    if tp_rule:
        return tp_rule
    cut = _cut_backward(reference, candidate, first_grads) if first_grads else ""
    if cut:
        return cut
    if first_grads and reference.grad_norms and candidate.grad_norms and _losses_compared(reference, candidate):
        return Hint(("gradient",),
                "same loss but every gradient differs from step 0, by no one factor, and both runs clip: likely a "
                "clipping norm other than the whole gradient's: each rank's own (its shards or experts alone, never "
                "summed over the ranks), or a micro-batch's partial sum clipped inside the accumulation loop")
    if first_grads and not _losses_compared(reference, candidate):
        return Hint(("loss", "gradient"),
                "every gradient differs from step 0 (no losses were reported, so the forward cannot be told apart "
                "from the backward): likely the loss weighting (a mean of micro-batch means over uneven micro-batches "
                "or token counts), or zero_grad, clipping or GradScaler unscale_ inside the accumulation loop",
                micro_batches=True)
    if first_grads:
        return Hint(("gradient",),
                "same loss but every gradient differs from step 0: the micro-batch gradients were altered before "
                "being summed; likely zero_grad, gradient clipping or GradScaler unscale_ inside the accumulation loop",
                micro_batches=True)
    steps = [m.first_step for m in mismatches if m.first_step is not None]
    tail = _epoch_tail(reference.batch_samples, min(steps)) if steps else ""
    if tail:
        return Hint(("loss", "gradient"), tail)
    if steps:
        return Hint(("state", "optimizer", "forward", "loss"),
                f"everything matches at step 0 and diverges from step {min(steps)}: state carried between steps "
                "differs, or a difference that clipping hid while the gradient norm stayed above max_norm (a "
                "missing / K clips to the same gradient); likely the RNG stream (dropout), optimizer state, a "
                "learning-rate schedule, or a scaling bug under clipping")
    return ""


def _cut_backward(reference: RunResult, candidate: RunResult, first_grads: set[str]) -> Hint | str:
    """The backward cut short at step 0: gradients it never reached in the run (zeros where the reference's carry
    one), or some gradients parting while others that carry one match (a frozen parameter's zeros match whatever the
    cut); "" where neither."""
    starved = sorted(name for name in first_grads if name in candidate.grads[0]
                     and not bool(candidate.grads[0][name].any()) and bool(reference.grads[0][name].any()))
    if starved:
        return Hint(("backward",), f"at step 0 {few(starved)} got no gradient (zeros) where the reference's carry "
                    "one: the backward never reached them; likely a reentrant checkpoint whose inputs need no "
                    "gradient (use_reentrant=False, or inputs that require grad), a detach or no_grad around them, "
                    "or parameters frozen by mistake", between_modules=True)
    exact = sorted(name for name, grad in reference.grads[0].items() if name not in first_grads and bool(grad.any()))
    if exact:
        return Hint(("backward",), f"at step 0 only some gradients differ ({few(sorted(first_grads))}) while "
                    f"{few(exact)} match: the backward pass was cut upstream; likely a detach between per-token or "
                    "per-chunk backward calls (an RNN hidden state detached = truncated BPTT)", between_modules=True)
    return ""


FEW = 4  # names a hint lists before it counts the rest: the location says where, the hint only what kind


def few(names: list[str]) -> str:
    """``a, b, c, d and 40 more``: a hint names a few, never a model's every parameter."""
    shown = ", ".join(names[:FEW])
    return shown + (f" and {len(names) - FEW} more" if len(names) > FEW else "")


def _clipped_at(candidate: RunResult) -> str:
    """The reference spec that clips as the candidate seems to: at the norm of its step-0 gradients, which a step that
    clipped there left at its threshold."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(as_real(g).double())
                                                 for g in candidate.grads[0].values()])).item()
    threshold = float(f"{norm:.3g}")
    return (f" (the run's gradient norm at step 0 is {norm:.6g}: a step that clips at {threshold:g} is held to "
            f"reference=\"full_batch:max_norm={threshold:g}\", or to Case(max_norm={threshold:g}))")


def _epoch_tail(samples: tuple[int, ...], first: int) -> str:
    """Where the first divergent step is an epoch's smaller last batch, or the step right after one."""
    full = max(samples, default=0)
    if first < len(samples) and samples[first] < full:
        return (f"every step matches until step {first}, an epoch's last, smaller global batch ({samples[first]} of "
                f"{full} samples): likely that batch weighted as a full one (each micro-batch's mean / K over fewer "
                "micro-batches, or a loss sum over the configured batch size instead of the batch's own count)")
    if 0 < first < len(samples) and samples[first - 1] < full:
        return (f"every step matches until step {first}, the first after an epoch's last, smaller global batch (step "
                f"{first - 1}, which matches): likely that partial window's gradients left in .grad into the next "
                "epoch (a step after the epoch without optimizer.zero_grad())")
    return ""


def _losses_compared(reference: RunResult, candidate: RunResult) -> bool:
    return any(r is not None and c is not None for r, c in zip(reference.losses, candidate.losses))


def _step_count(expected: int, taken: int, pattern: tuple[int, ...] | None) -> str:
    """What the step counts say, with the steps each global batch took where the run could tell."""
    if pattern and len(set(pattern)) == 1:
        per = f" ({pattern[0]} per global batch)"
    else:
        per = f" (per global batch: {', '.join(map(str, pattern))})" if pattern else ""
    if taken == 0:
        return (f"0 optimizer steps where the reference took {expected}: the code checked never called "
                "optimizer.step() (or a GradScaler skipped every step on non-finite gradients)")
    if taken < expected:
        return (f"{taken} optimizer steps where the reference took {expected}{per}: some global batches were never "
                "stepped; likely a step under a condition that misses (an off-by-one in `(i + 1) % K == 0`, a "
                "partial last window)")
    return (f"{taken} optimizer steps where the reference took {expected}{per}: likely optimizer.step() "
            "(or GradScaler.step) per micro-batch instead of once per global batch")


def _tensor_parallel(reference: RunResult, candidate: RunResult, first_grads: set[str]) -> str:
    """On a run that communicated over tp, where some step-0 gradients are one factor k x the reference's and the rest
    match: the parameters a TP group replicates (norms, row biases), their gradient summed or averaged wrongly over
    tp. Where every step-0 gradient differs by no one factor: the loss weighting over the data-parallel shards."""
    if not first_grads or not reference.grads or not candidate.grads:
        return ""
    if len(first_grads) == len(reference.grads[0]):
        if common_factor(reference, candidate) is not None:
            return ""
        return Hint(("loss",),
                "every gradient differs from step 0 on a tensor-parallel mesh, by no one factor: likely the loss "
                "weighting over the data-parallel shards (a shard's own mean averaged over dp where shards hold other "
                "item counts), or the TP ranks handed other batches")
    factors = {name: factor_of(reference.grads[0][name], candidate.grads[0].get(name)) for name in sorted(first_grads)}
    found = set(factors.values())
    if len(found) != 1 or None in found or not _whole_ratio(next(iter(found))):
        return ""
    factor = next(iter(found))
    names = ", ".join(factors)
    why = (f"their gradient averaged over the TP group where it must be summed (a sequence-parallel norm's gradients "
           f"all-reduced with a mean: 1/{round(1 / factor)})" if factor < 1 else
           f"counted {round(factor)} times: a row bias added on every TP rank before the reduce, or a replicated "
           "gradient all-reduced over tp where every rank held the whole already")
    return Hint(("communication", "gradient", "backward"),
            f"at step 0 the gradients of {names} are {factor:.6g} x the reference's and the others match: parameters "
            f"the TP group replicates, {why}")


def _whole_ratio(factor: float) -> bool:
    """Whether ``factor`` is n or 1/n for a whole n >= 2: what a TP group of n ranks makes of a sum or a mean."""
    n = factor if factor > 1 else 1 / factor
    return n >= 1.5 and abs(n - round(n)) < 1e-3


def factor_of(reference: Tensor, candidate: Tensor | None) -> float | None:
    """The c with candidate == c * reference for one tensor (:func:`_scaled_by`), to 6 digits, or None."""
    if candidate is None:
        return None
    factor = _scaled_by(as_real(reference).reshape(-1).double(), as_real(candidate).reshape(-1).double())
    return None if factor is None else round(factor, 6)


def _scaled_by(ref: Tensor, cand: Tensor) -> float | None:
    """The c with ``cand == c * ref`` (flat float64 tensors) to a relative residual of FACTOR_RESIDUAL, or None."""
    norm = float(ref.dot(ref))
    if norm == 0.0 or ref.shape != cand.shape:
        return None
    factor = float(cand.dot(ref)) / norm
    residual = float((cand - factor * ref).norm()) / (abs(factor) * norm ** 0.5 or 1.0)
    return factor if residual <= FACTOR_RESIDUAL else None


def common_factor(reference: RunResult, candidate: RunResult) -> float | None:
    """The c != 1 with candidate == c * reference for every step-0 gradient, if there is one."""
    if not reference.grads or not candidate.grads or reference.grads[0].keys() != candidate.grads[0].keys():
        return None
    ref = torch.cat([as_real(g).reshape(-1).double() for g in reference.grads[0].values()])
    cand = torch.cat([as_real(candidate.grads[0][name]).reshape(-1).double() for name in reference.grads[0]])
    factor = _scaled_by(ref, cand)
    return None if factor is None or abs(factor - 1.0) < 10 * FACTOR_RESIDUAL else factor


def unsynchronised_ranks(result: RunResult, atol: float) -> tuple[int, tuple[int, ...], float] | None:
    """The first step at which some ranks' gradients differed from rank 0's by more than ``atol``, those
    ranks, and the greatest difference; None where every rank held the same gradients (or one ran)."""
    for step, spreads in enumerate(result.rank_grad_spread or ()):
        ranks = tuple(rank for rank, spread in enumerate(spreads) if spread > atol)
        if ranks:
            return step, ranks, max(spreads)
    return None
