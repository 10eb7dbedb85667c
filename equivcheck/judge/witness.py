"""Rounding witnessed without a higher precision: the reference again, its samples in another order (or, for a
chaotic reference that reordering does not shake, its backward at another scale: ``RESCALED``).

The mean over a global batch's items does not depend on the order its samples come in, so the reference
trained on each batch's samples reversed (and rolled by half) differs from the reference by rounding alone;
where it differs beyond the tolerance, rounding alone moves those elements that far. That happens where a
parameter's true gradient is zero: softmax ignores a constant added to every score of a row, so a key bias's
gradient is zero in exact arithmetic, and what autograd computes is noise whose sign and size follow the
summation order; an adaptive optimizer divides by that noise's running RMS and makes whole-size updates of
it. A convolution's bias before a BatchNorm is the same. A float64 shadow cannot tell: its noise is amplified
just the same.

The judgement, quantity by quantity (a step's gradient of a parameter, a final weight or buffer):

- an element is *noise-driven* where its reference gradient is at rounding level at every step (a buffer's,
  where a witness moves it beyond the tolerance);
- a candidate's mismatched element is rounding where it is noise-driven and the candidate moved it from its true
  value (a zero gradient; a weight where it started) no more than ``WITNESS_FACTOR`` times the furthest the
  reference or a witness did: rounding moves such an element, and nothing else may (a buffer, whose true value
  is unknown: its difference within that many times the witnesses' greatest);
- every other mismatch stands, with the witness's figure beside it, unless the whole run started equal and the
  reference itself, reordered or rescaled, ends as far apart on that quantity (the chaotic rule, :func:`_diverging`).

A mismatch in the loss is never judged so (a parameter whose gradient is zero changes nothing the loss sees),
and a witness counts only where its losses match the reference's: one whose losses differ is not neutral (a
forward that draws randomness per sample, as dropout does, pairs other draws with other samples), so it
judges nothing and the verdict stands, saying why.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..diff import Comparison, Mismatch, as_real
from ..precision import Tolerance
from .compare import compare
from ..result import RunResult

ORDERS = ("reversed", "rolled")  # the witnesses: each global batch's samples reversed, and rolled by half
# More witnesses where the reordered ones' spread does not cover a chaotic candidate: the batch as given, its
# backward at other scales (train.rescaled_backward). Reordering a batch of three samples may change no rounding that
# decides a tiny gradient's sign; a regime that splits the batch does, and so do these. No scale is a power of two,
# so that every product and sum of the backward rounds otherwise; each is below one, so nothing overflows that did not.
BACKWARD_SCALES = (0.7, 0.8, 0.9)
RESCALED = tuple(f"rescaled_{scale}" for scale in BACKWARD_SCALES)


# How much further than the reference and its witnesses a candidate may move a noise-driven element. Three runs'
# noise is a sample, not a bound: Adam moves such an element by up to its learning rate a step, further where the
# noise keeps its sign (per-sample sums flip it less than reordering does). Measured over 2,000 drawn attention
# LMs (bench_false_alarms.py --attention 2000): 2 false alarms at 2, 1 at 3, which is of another kind (docs).
WITNESS_FACTOR = 3.0

# A reordered witness is the reference's maths rounded otherwise. Where its losses match and its first step is apart
# by at most this many times the tolerance, that is the mode's own rounding at the tolerance's edge, and it starts
# equal: bf16 compute over a batch of 17 in another order parts a LayerNorm gradient at margin 1.11. What sets a
# witness truly apart at its first step shows in its losses (randomness drawn per sample, as dropout's). A rescaled
# witness is held to the tolerance itself: one whose gradient reached a parameter by another path than the backward
# comes out divided by its scale, a difference that bf16's absolute tolerance can hide below a margin of 2.
STARTS_EQUAL_WITHIN = 2.0


# A gradient element at most this many machine epsilons of the step's greatest gradient is at rounding level: a
# true gradient of zero computes to about eps times the terms it sums (1e-16 of the rest in float64 here, 2e-8 in
# float32), a real one, however small, far above. Not under autocast, whose gradients are float32 sums of 16-bit
# products: there a key bias's noise (4e-5 of the greatest, bf16) is as large as the smallest real gradients, so
# which elements are at rounding level is read from the reference trained in float32 (``levels``: check.py).
ROUNDING_LEVEL = 64


def backward_scale(order: str) -> float | None:
    """The scale a witness's ``order`` runs its backward at; None for one that keeps it (all but a rescaled one)."""
    return float(order.removeprefix("rescaled_")) if order.startswith("rescaled_") else None


def applies(comparison: Comparison, reference: RunResult, candidate: RunResult,
            levels: Callable[[], Mapping[str, Tensor]] | None = None) -> bool:
    """Whether the witnesses could explain ``comparison``: numbers only, not the loss (a parameter whose gradient
    is zero changes nothing the loss sees), and every mismatched weight or gradient mismatched somewhere its
    reference gradient is at rounding level at every step (read from ``levels()``, where given: the reference
    without autocast). Otherwise the verdict stands without witness runs."""
    if not comparison.mismatches or comparison.problems or comparison.tolerance.source:
        return False
    if comparison.first_divergent_step != 0:  # every gradient equal at step 0, apart later (or only the end weights):
        return True                            # perhaps amplified rounding
    graded = _graded(reference, levels)
    return all(m.kind == "buffer" or (m.kind in ("grad", "weight") and bool(
        (_mismatched(m, reference, candidate, comparison.tolerance) & graded(m.name)).any()))
        for m in comparison.mismatches)


def _at_rounding_level(reference: RunResult, name: str, largest: Sequence[float] | None = None) -> Tensor:
    """The elements of parameter ``name`` whose gradient in ``reference`` is at rounding level at every step
    (``largest``: each step's greatest gradient, where already known)."""
    level = None
    for step, grads in enumerate(reference.grads):
        greatest = _largest(grads) if largest is None else largest[step]
        grad = as_real(grads[name])
        small = grad.abs() <= ROUNDING_LEVEL * torch.finfo(grad.dtype).eps * greatest
        level = small if level is None else level & small
    return level if level is not None else torch.zeros(as_real(reference.weights[name]).shape, dtype=torch.bool)


def _largest(grads: dict[str, Tensor]) -> float:
    return max(float(as_real(g).abs().max()) for g in grads.values() if g.numel())


def rounding_levels(run: RunResult) -> dict[str, Tensor]:
    """Every parameter's elements whose gradient in ``run`` is at rounding level at every step: what the reference
    trained without autocast says for an autocast check (check.py), kept without the run's own tensors."""
    largest = [_largest(grads) for grads in run.grads]
    return {name: _at_rounding_level(run, name, largest) for name in run.weights}


def _graded(reference: RunResult, levels: Callable[[], Mapping[str, Tensor]] | None) -> Callable[[str], Tensor]:
    """Parameter name -> its elements at rounding level: read from the reference's gradients (each step's greatest
    found once, not once a parameter), or from ``levels()``, asked only when a name is."""
    if levels is not None:
        return lambda name: levels()[name]
    largest = functools.cache(lambda: [_largest(grads) for grads in reference.grads])
    return lambda name: _at_rounding_level(reference, name, largest())


def _mismatched(mismatch: Mismatch, reference: RunResult, candidate: RunResult, tol: Tolerance) -> Tensor:
    if mismatch.kind == "weight":
        expected, actual = reference.weights[mismatch.name], candidate.weights[mismatch.name]
    else:  # a gradient, at the mismatch's own worst step
        expected, actual = (run.grads[mismatch.worst_step][mismatch.name] for run in (reference, candidate))
    actual, expected = _float64(actual), _float64(expected)
    return (actual - expected).abs() > tol.atol + tol.rtol * expected.abs()


def _float64(tensor: Tensor) -> Tensor:
    """``tensor`` in float64, a complex one as its real and imaginary parts: elements of their own, as compare.py
    judges them."""
    return as_real(tensor).double()


@dataclasses.dataclass(frozen=True)
class Noise:
    """What the witnesses show on one mismatched quantity."""

    mismatch: Mismatch
    driven: str  # the noise-driven elements, named: "attn.in_proj_bias[16:32]"
    noise: float  # the greatest difference a witness shows on them
    moved: float  # how far the runs (reference, witnesses) moved them from their true value: rounding, amplified
    gradient: float  # the reference's greatest gradient there: rounding level where the true gradient is zero
    strayed: float  # the candidate's greatest difference there
    explained: bool  # every mismatched element is noise-driven and within WITNESS_FACTOR * noise
    margin: float  # the greatest |candidate - reference| / (allowed + WITNESS_FACTOR * noise where noise-driven)
    witnessed: bool = True  # False: the reference alone measured the rounding (by_the_reference)
    driven_within: bool = True  # every noise-driven element within its bound: what is apart has a real gradient

    def describe(self) -> str:
        zero = "" if self.mismatch.kind == "buffer" else f"true gradient zero (the reference's is {self.gradient:.2g}), "
        seen = (f"the reference in another sample order differs there by up to {self.noise:.3g}, rounding moved it "
                if self.witnessed else "the reference's own rounding moved it ")
        return (f"{self.mismatch.kind} of {self.driven}: {zero}{seen}up to {self.moved:.3g} from its true value, and "
                f"the candidate differs by {self.strayed:.3g}")


def judge(comparison: Comparison, reference: RunResult, candidate: RunResult,
          witnesses: Callable[[Sequence[str]], Sequence[RunResult]], initial: Callable[[], dict[str, Tensor]],
          cause: Callable[[], str], levels: Callable[[], Mapping[str, Tensor]] | None = None) -> Comparison:
    """``comparison`` (failed, :func:`applies`) judged by the witnesses: equivalent with a note naming every
    noise-driven parameter where rounding explains every mismatch, else the mismatches rounding does not
    explain, with a note on those it does. ``levels``: as :func:`applies` takes it."""
    try:
        runs = witnesses(ORDERS)
    except Exception as error:  # the verdict stands; say why it could not be weighed
        return _noted(comparison, f"the witness runs failed: {type(error).__name__}: {error}")
    neutral = [run for run in runs if _losses_match(reference, run, comparison.tolerance)]
    if not neutral:
        return _diverging(comparison, reference, candidate, runs, cause, lambda: witnesses(RESCALED))
    graded = _graded(reference, levels)
    noises = {m: _noise(m, reference, candidate, neutral, initial(), comparison.tolerance, graded)
              for m in comparison.mismatches}
    explained = [n for n in noises.values() if n is not None and n.explained]
    note = comparison.note if not explained else f"ill-conditioned: {cause()}: " + "; ".join(
        n.describe() for n in explained) + (f" (before this witness: {comparison.note})" if comparison.note else "")
    margins = [n.margin for n in explained]
    # What the noise-driven elements do not explain, the chaotic rule may (:func:`_diverging`): where the trajectories
    # parted at a later step, every such quantity (rounding amplified there moves every element, a noise-driven one
    # too); where only the end weights are apart, a quantity whose noise-driven elements all stayed within their bound
    # (a real but tiny gradient's sign, which Adam without epsilon makes a whole step): there a noise-driven element
    # moved beyond rounding stands, however wide the witnesses' spread.
    parted = (comparison.first_divergent_step or 0) >= 1
    standing = tuple(m for m in comparison.mismatches if not (noises[m] and noises[m].explained))
    undecided = tuple(m for m in standing if parted or noises[m] is None or noises[m].driven_within)
    if undecided:
        rest = _diverging(dataclasses.replace(comparison, mismatches=undecided, note=note), reference, candidate, runs,
                          cause, lambda: witnesses(RESCALED), from_step=comparison.first_divergent_step)
        if rest.ok:
            standing, margins = tuple(m for m in standing if m not in undecided), margins + [rest.margin]
            note = f"{note}; {rest.note}" if explained else rest.note
        else:
            note = rest.note
    if standing:
        return dataclasses.replace(comparison, mismatches=standing, note=note)
    margin = max(margins + [_margin_elsewhere(reference, candidate, comparison)])
    return Comparison(comparison.tolerance, (), (), comparison.max_abs, comparison.max_rel, margin, note=note)


def by_the_reference(comparison: Comparison, reference: RunResult, candidate: RunResult,
                     initial: Callable[[], dict[str, Tensor]], cause: Callable[[], str],
                     levels: Callable[[], Mapping[str, Tensor]] | None = None) -> Comparison:
    """``comparison`` judged by the reference's own rounding, before any other run: where every gradient matched and
    the final weights are apart only on elements whose reference gradient is at rounding level at every step, the
    reference moved those elements from where they started by rounding alone, and the candidate may move them up to
    ``WITNESS_FACTOR`` times as far (the witnesses' rule, with one run's sample where they have three). Equivalent
    with a note where that explains every mismatch; else ``comparison`` unchanged, for the float64 shadows and the
    witnesses. An Adam-trained attention model's key biases are such elements: this spares its check the shadows'
    float64 memory and the witnesses' runs. A candidate compared as it trained brings its weights beyond the
    tolerance (``Measurement.strayed``), so it is not trained again to read them. ``levels``: as :func:`applies`
    takes it (under autocast, one float32 training, still far cheaper than two float64 ones)."""
    explained = rounding_alone(comparison, reference, candidate, initial, levels)
    if explained is None:
        return comparison
    noises, margin = explained
    return Comparison(comparison.tolerance, (), (), comparison.max_abs, comparison.max_rel, margin,
                      note=f"ill-conditioned: {cause()}: {noises}")


def rounding_alone(comparison: Comparison, reference: RunResult, candidate: RunResult,
                   initial: Callable[[], dict[str, Tensor]],
                   levels: Callable[[], Mapping[str, Tensor]] | None = None) -> tuple[str, float] | None:
    """Where the reference's own rounding explains every mismatch of ``comparison`` (:func:`by_the_reference`'s rule):
    the noise-driven elements, described, and the whole comparison's margin; else None. Float64 shadows judged so
    (rounding.py) differ by what Adam without epsilon makes of a key bias's rounding-level gradient, which is no
    difference in the maths."""
    found = _end_weight_noises(comparison, reference, candidate, initial, levels)
    if found is None:
        return None
    candidate, noises = found
    if not all(noise is not None and noise.explained for noise in noises):
        return None
    margin = max([noise.margin for noise in noises] + [_margin_elsewhere(reference, candidate, comparison)])
    return "; ".join(noise.describe() for noise in noises), margin


def _end_weight_noises(comparison: Comparison, reference: RunResult, candidate: RunResult,
                       initial: Callable[[], dict[str, Tensor]], levels: Callable[[], Mapping[str, Tensor]] | None,
                       ) -> tuple[RunResult, list[Noise | None]] | None:
    """Where only end weights are apart (every gradient matched): ``candidate`` with the weights a run compared as it
    trained kept beyond the tolerance (``Measurement.strayed``), and each mismatch's noise as the reference alone
    measures it; None where anything else differs or either run lacks a mismatched weight."""
    if comparison.ok or comparison.problems or comparison.tolerance.source or any(
            m.kind != "weight" for m in comparison.mismatches):
        return None
    weights = {**candidate.weights, **(candidate.measured.strayed if candidate.measured is not None else {})}
    if any(m.name not in weights or m.name not in reference.weights for m in comparison.mismatches):
        return None
    kept, graded = dataclasses.replace(candidate, weights=weights), _graded(reference, levels)
    return kept, [_noise(m, reference, kept, [], initial(), comparison.tolerance, graded)
                  for m in comparison.mismatches]


def end_weights_as_it_trained(comparison: Comparison, reference: RunResult, candidate: RunResult,
                              witness: Callable[[], RunResult], initial: Callable[[], dict[str, Tensor]],
                              cause: Callable[[], str],
                              levels: Callable[[], Mapping[str, Tensor]] | None = None) -> Comparison | None:
    """The chaotic rule for a candidate compared as it trained that is apart only in its end weights, every gradient
    matched: judged against one ``witness`` (the reference with its samples reversed) compared as it trains too, before
    any float64 shadow. Each run's greatest difference per quantity is all the rule reads, so nothing more is recorded.
    One witness is a subset of the evidence :func:`judge` weighs, so where it covers the candidate all of them would;
    and a quantity with a noise-driven element beyond the reference's own bound (read from the candidate's kept
    weights) is left to the full judgement, as :func:`judge` leaves it standing. Equivalent where the witness covers
    every mismatch; else None, and the shadows and the witnesses recorded whole come next. A bf16 check of a 124M
    transformer so settles one key-projection weight 1.008 times the tolerance apart with one run, not two float64
    ones."""
    found = (None if candidate.measured is None else
             _end_weight_noises(comparison, reference, candidate, initial, levels))
    if found is None or any(noise is not None and not noise.driven_within for noise in found[1]):
        return None
    judged = _diverging(comparison, reference, candidate, [witness()], cause)
    return judged if judged.ok else None


def _diverging(comparison: Comparison, reference: RunResult, candidate: RunResult, witnesses: Sequence[RunResult],
               cause: Callable[[], str], more: Callable[[], Sequence[RunResult]] | None = None,
               from_step: int | None = None) -> Comparison:
    """The reference may itself be chaotic: where a witness starts equal to it (step 0 within the tolerance: the
    same weights, only the summation order differs) and ends apart beyond the tolerance, rounding alone is
    amplified to that size. The candidate is then judged against that spread: equivalent where every mismatched
    quantity differs from the reference by at most ``WITNESS_FACTOR`` times the furthest a witness does, said as
    such (differences smaller than that spread cannot be seen at all). Where the reordered witnesses' spread does not
    cover the candidate, ``more`` witnesses (the backward at other scales) are drawn and counted too. A witness apart
    from step 0 on (dropout's draws paired with other samples; a rescaled one whose gradients reach a parameter by
    another path than the backward) is no witness: the verdict stands. ``from_step``: the step the whole run diverged
    from, where ``comparison`` holds only the mismatches the noise-driven elements did not explain (:func:`judge`): a
    key bias that Adam moves by its learning rate shifts every score of a row alike, which softmax ignores exactly and
    float32 does not, so the other weights part by rounding from a later step."""
    tol = comparison.tolerance
    first = comparison.first_divergent_step if from_step is None else from_step
    witnessed = [compare(reference, w, tolerance=tol) for w in witnesses]
    if not all(_starts_equal(seen) for seen in witnessed):
        return _noted(comparison, "no witness: the reference's losses change with the order of its samples from the "
                                  "first step (randomness drawn per sample?), so rounding could not be told from the maths")
    if first == 0:  # apart from the first step: no rounding amplified over training explains that
        return comparison
    diverging = [(w, seen) for w, seen in zip(witnesses, witnessed) if _apart_later(seen, STARTS_EQUAL_WITHIN)]
    worst = _worst_ratio(comparison, reference, candidate, [w for w, _ in diverging]) if diverging else float("inf")
    how = "its samples in another order"
    if more is not None and worst > 1:
        rescaled = [(w, seen) for w in more() for seen in [compare(reference, w, tolerance=tol)] if _apart_later(seen)]
        if rescaled:
            diverging += rescaled
            worst = _worst_ratio(comparison, reference, candidate, [w for w, _ in diverging])
            how += " or its backward at another scale"
    if not diverging:
        return comparison
    spread_margin = max(seen.margin for _, seen in diverging)
    note = (f"chaotic: {cause()}: the reference itself, {how}, starts equal and ends apart "
            f"(margin {spread_margin:.3g} against {tol}): differences within {WITNESS_FACTOR:g} times the furthest "
            "two of them end apart are rounding, and a difference smaller than that cannot be seen")
    if worst > 1:
        return _noted(comparison, note + f"; the candidate differs by up to {worst:.3g} times that")
    return Comparison(tol, (), (), comparison.max_abs, comparison.max_rel, worst, note=note)


def _worst_ratio(comparison: Comparison, reference: RunResult, candidate: RunResult,
                 diverging: Sequence[RunResult]) -> float:
    """The greatest of each mismatched quantity's difference over ``WITNESS_FACTOR`` times the spread: the furthest
    apart any two runs of the reference's maths end, the reference and each witness, rounded otherwise (a witness
    compared as it trained keeps its figures against the reference alone)."""
    runs = [reference, *diverging]
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1:] if i == 0 or (
        a.measured is None and b.measured is None)]
    ratios = []
    for mismatch in comparison.mismatches:
        spread = max(_greatest_difference(mismatch, a, b) for a, b in pairs)
        ratios.append(_greatest_difference(mismatch, reference, candidate) / (WITNESS_FACTOR * spread)
                      if spread else float("inf"))
    return max(ratios)


def _starts_equal(witnessed: Comparison, within: float = STARTS_EQUAL_WITHIN) -> bool:
    """Whether a witness's first step matches the reference's: its losses within the tolerance, every other quantity
    within ``within`` times it."""
    return not any(m.first_step == 0 and (m.kind == "loss" or m.step_margins[0] > within)
                   for m in witnessed.mismatches)


def _apart_later(witnessed: Comparison, within: float = 1.0) -> bool:
    """Whether a witness starts equal (``within``: :func:`_starts_equal`) and ends apart beyond the tolerance."""
    return (not witnessed.ok and not witnessed.problems and _starts_equal(witnessed, within)
            and any(m.first_step != 0 for m in witnessed.mismatches))


def _greatest_difference(mismatch: Mismatch, reference: RunResult, other: RunResult) -> float:
    """The greatest absolute difference of ``mismatch``'s quantity between two runs, over its steps."""
    name = mismatch.name
    if mismatch.kind != "loss" and other.measured is not None:  # compared as it trained: its figures, no tensors
        return max((diff.max_abs for _, diff in other.measured.series.get((mismatch.kind, name), ())), default=0.0)
    if mismatch.kind == "grad":
        return max(float((_float64(a[name]) - _float64(b[name])).abs().max())
                   for a, b in zip(reference.grads, other.grads))
    if mismatch.kind == "loss":
        return max((abs(a - b) for a, b in zip(reference.losses, other.losses) if None not in (a, b)), default=0.0)
    field = "weights" if mismatch.kind == "weight" else "buffers"
    return float((_float64(getattr(reference, field)[name]) - _float64(getattr(other, field)[name])).abs().max())


def _noted(comparison: Comparison, note: str) -> Comparison:
    return dataclasses.replace(comparison, note="; ".join(filter(None, (comparison.note, note))))


def _margin_elsewhere(reference: RunResult, candidate: RunResult, comparison: Comparison) -> float:
    """The greatest margin over every quantity that matched (the judged ones excepted), so that the verdict's
    margin is the whole comparison's: from the measurement of a candidate compared as it trained."""
    judged = {(m.kind, m.name) for m in comparison.mismatches}
    tol, margin = comparison.tolerance, 0.0
    if candidate.measured is not None:
        margin = max((diff.margin for key, entries in candidate.measured.series.items() if key not in judged
                      for _, diff in entries), default=0.0)
        losses = [(r, c) for r, c in zip(reference.losses, candidate.losses) if None not in (r, c)]
        return max([margin] + [abs(c - r) / (tol.atol + tol.rtol * abs(r)) for r, c in losses if c != r])
    pairs = [(("grad", n), ref[n], cand[n]) for ref, cand in zip(reference.grads, candidate.grads) for n in ref]
    pairs += [(("weight", n), t, candidate.weights[n]) for n, t in reference.weights.items()]
    pairs += [(("buffer", n), t, candidate.buffers[n]) for n, t in reference.buffers.items()]
    losses = [(r, c) for r, c in zip(reference.losses, candidate.losses) if None not in (r, c)]
    if losses:
        pairs.append((("loss", "loss"), *(torch.tensor(series, dtype=torch.float64) for series in zip(*losses))))
    for key, expected, actual in pairs:
        if key in judged or not expected.numel():
            continue
        expected = _float64(expected)
        gap = (_float64(actual) - expected).abs()
        margin = max(margin, float(torch.where(gap == 0, 0.0, gap / (tol.atol + tol.rtol * expected.abs())).max()))
    return margin


def _losses_match(reference: RunResult, witness: RunResult, tol: Tolerance) -> bool:
    losses = [(r, w) for r, w in zip(reference.losses, witness.losses) if None not in (r, w)]
    return all(abs(w - r) <= tol.atol + tol.rtol * abs(r) for r, w in losses)


def _noise(mismatch: Mismatch, reference: RunResult, candidate: RunResult, witnesses: list[RunResult],
           initial: dict[str, Tensor], tol: Tolerance, graded: Callable[[str], Tensor]) -> Noise | None:
    """The evidence on ``mismatch``'s quantity, over each of its steps; None where nothing of it is noise-driven.

    Where: a parameter's elements whose reference gradient is at rounding level at every step, whatever sign the
    noise took in one order or another (a buffer's: those a witness moves beyond the tolerance). How far: the
    true value of such an element is known (its gradient is zero; its weight stays where it started), so what
    the reference and each witness moved it from there is rounding, amplified. The candidate's own movement
    there must stay within ``WITNESS_FACTOR`` times the greatest of theirs (a buffer's difference, within that
    many times the witnesses' greatest difference). ``graded``: a parameter's elements at rounding level, read from
    the reference or from the reference without autocast (:func:`_graded`)."""
    if mismatch.kind == "loss":  # the loss sees every parameter that matters: never noise on one that does not
        return None
    level = None if mismatch.kind == "buffer" else graded(mismatch.name)
    driven = torch.zeros(0, dtype=torch.bool)
    noise = moved_most = gradient = strayed = margin = 0.0
    explained = driven_within = True
    for expected, actual, seen, grads, true in _tensors(mismatch, reference, candidate, witnesses, initial):
        expected, actual = _float64(expected), _float64(actual)
        allowed = tol.atol + tol.rtol * expected.abs()
        apart = (torch.stack([(_float64(w) - expected).abs() for w in seen]).amax(dim=0) if seen
                 else torch.zeros_like(expected))
        noisy = (apart > allowed) if level is None else level
        gap = (actual - expected).abs()
        matched = gap <= allowed
        if not noisy.any():
            explained &= bool(matched.all())
            margin = max(margin, float(torch.where(gap == 0, 0.0, gap / allowed).max()))
            continue
        if true is None:  # a buffer: the witnesses' spread is the scale, the difference what is judged
            scale, stray = float(apart[noisy].max()), gap
        else:
            true = _float64(true).to(expected.device)  # built on the run's device, recorded on the CPU
            scale = max(float((run - true).abs()[noisy].max()) for run in [expected, *(_float64(w) for w in seen)])
            stray = (actual - true).abs()
        within = noisy & (stray <= WITNESS_FACTOR * scale)
        explained &= bool((matched | within).all())
        driven_within &= bool((matched | within | ~noisy).all())
        ratio = torch.where(noisy, stray / max(WITNESS_FACTOR * scale, tol.atol), gap / allowed)
        margin = max(margin, float(torch.where(gap == 0, 0.0, ratio).max()))
        noise, moved_most = max(noise, float(apart[noisy].max())), max(moved_most, scale)
        strayed = max(strayed, float(gap[noisy].max()))
        gradient = max([gradient] + [float(_float64(g)[noisy].abs().max()) for g in grads])
        driven = noisy.reshape(-1) if not driven.numel() else driven | noisy.reshape(-1)
    if not driven.numel() or moved_most == 0:
        return None
    return Noise(mismatch, _name_elements(mismatch.name, driven, reference, mismatch.kind), noise, moved_most,
                 gradient, strayed, explained, margin, witnessed=bool(witnesses), driven_within=driven_within)


def _tensors(mismatch: Mismatch, reference: RunResult, candidate: RunResult, witnesses: list[RunResult],
             initial: dict[str, Tensor]) -> Iterator[tuple[Tensor, Tensor, list[Tensor], list[Tensor], Tensor | None]]:
    """(reference's, candidate's, each witness's, the reference's gradients, the true value where rounding cannot
    have moved it: zero for a gradient, the start for a weight, unknown for a buffer) of the quantity at each step."""
    name = mismatch.name
    if mismatch.kind == "grad":
        for step, (ref, cand) in enumerate(zip(reference.grads, candidate.grads)):
            yield ref[name], cand[name], [w.grads[step][name] for w in witnesses], [ref[name]], torch.zeros(())
    else:
        field = "weights" if mismatch.kind == "weight" else "buffers"
        yield (getattr(reference, field)[name], getattr(candidate, field)[name],
               [getattr(w, field)[name] for w in witnesses], [step[name] for step in reference.grads if name in step],
               initial.get(name) if mismatch.kind == "weight" else None)


def _name_elements(name: str, driven: Tensor, reference: RunResult, kind: str) -> str:
    """``name[16:32]`` for a vector's contiguous runs of noise-driven elements, else how many of how many."""
    count, total = int(driven.sum()), driven.numel()
    shape = (reference.weights.get(name) if kind != "buffer" else reference.buffers.get(name))
    if shape is not None and shape.is_complex() and count != total:
        return f"'{name}' ({count} of {total} real and imaginary parts)"
    if shape is None or shape.dim() != 1 or count == total:
        return f"'{name}'" + ("" if count == total else f" ({count} of {total} elements)")
    runs, start = [], None
    for index, flag in enumerate([*driven.tolist(), False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append(f"{start}:{index}")
            start = None
    return f"'{name}'[{', '.join(runs)}]"


