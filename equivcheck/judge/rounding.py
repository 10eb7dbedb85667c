"""Maths or rounding: whether a float32 or autocast mismatch is the regime's or the case's own rounding.

A fixed tolerance table is not enough on an ill-conditioned case: a LayerNorm over two features gives
gradients at rounding level, and Adam scales every update to about its learning rate whatever the
gradient's size, so summing micro-batches in another order moves the weights by whole updates.
Float64 runs from the same float32 draws (the ``float64-shadow`` mode) settle it:

- the regime's shadow against the reference's shadow, at float64's tolerance: do the maths match?
- each low-precision run against its own shadow: how much rounding noise does each carry?

Where the maths match and both shadows start where the low-precision runs did (the same step-0 loss),
the low-precision difference is rounding: the verdict is equivalent, with a note naming what makes
the case ill-conditioned and the noise measured. Where the maths differ, the float64 runs' hint
speaks, free of rounding. A mode with a GradScaler has a shadow with one (``float64-shadow-scaled``):
a scaler misused per micro-batch changes the float64 maths too, so it never passes as rounding.

Measured on 400 random float32 MLPs under accumulation (widths 1-64, LayerNorm, Adam, AdamW, SGD):
the regime's rounding noise ranged from 0.0002 to 8,500 times the reference's, so no fixed multiple of
one run's noise bounds the other's; the float64 maths is the evidence, the noise its explanation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ..case import Case
from ..diff import Comparison, as_real
from ..precision import Tolerance
from .compare import Expected, compare, tolerance_of
from . import witness
from .hints import diagnose
from ..precision import BF16_SHADOW, SCALED_SHADOW, SHADOW, Precision
from ..result import RunResult
from ..process.seeding import seeded

# A LayerNorm or GroupNorm normalising over at most this many features cancels its inputs' gradients.
FEW_FEATURES = 4
ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
            torch.optim.Adagrad, torch.optim.RMSprop)


def applies(precision: Precision, comparison: Comparison) -> bool:
    """Only a low-precision run whose numbers (not its structure) differ: a step that a GradScaler
    skipped on overflow changes the step count, which no shadow explains away. Not a lossy regime judged at its
    own bound (``Tolerance.source``): its shadows would compare the compression at float64's tolerance."""
    return (precision.dtype != torch.float64 and bool(comparison.mismatches) and not comparison.problems
            and not comparison.tolerance.source)


def shadow_of(precision: Precision) -> str:
    """The float64 mode that does ``precision``'s maths exactly: through a GradScaler where it has one
    (a power-of-two scale is exact in float64, so the scaler adds no rounding of its own); from the draws rounded to
    bfloat16 for pure bf16, whose run starts from them (a shadow from the float32 draws starts elsewhere)."""
    if precision.grad_scaler:
        return SCALED_SHADOW
    return BF16_SHADOW if precision.dtype == torch.bfloat16 else SHADOW


def judge(case: Case, comparison: Comparison, reference: RunResult, candidate: RunResult,
          shadow_reference: Callable[[], RunResult], shadow_candidate: Callable[[], RunResult], *,
          seed: int, shadow_initial: Callable[[], dict[str, Tensor]] | None = None) -> Comparison:
    """``comparison`` (the low-precision one, which failed) judged by float64 shadows of both runs.

    Returns an equivalent comparison with a note where the mismatch is rounding, else ``comparison``
    with a hint and a note that say what the float64 runs showed. ``shadow_initial``: the weights the shadows start
    from, where the shadows' own rounding may explain how they differ (:func:`maths_alike`).
    """
    try:
        ref64, cand64 = shadow_reference(), shadow_candidate()
    except Exception as error:  # the low-precision verdict stands; say why it could not be weighed
        return dataclasses.replace(comparison, note=f"the float64 shadow runs failed: {type(error).__name__}: {error}")
    maths = compare(ref64, cand64)
    alike = maths_alike(maths, ref64, cand64, shadow_initial)
    if alike is None:  # the float64 runs' hint names the pitfall without rounding in the way
        maths = diagnose(ref64, cand64, maths)
        note = f"the float64 runs differ too (margin {maths.margin:.3g}): the maths differs"
        return dataclasses.replace(comparison, hint=maths.hint or comparison.hint, note=note)
    evidence = alike[0]
    for run, shadow in ((reference, ref64), (candidate, cand64)):
        gap = _start_gap(run, shadow, comparison.tolerance)
        if gap is not None:
            return dataclasses.replace(comparison, note=evidence, hint=(
                f"{evidence}, so the maths is the same; but a float64 shadow did not start where its "
                f"{run.precision} run did (step-0 loss {gap}: data or weights drawn differently per dtype), "
                "so the difference could not be attributed to rounding"))
    margin, ref_noise, cand_noise = _noise_margin(reference, candidate, ref64, cand64, comparison.tolerance)
    note = (f"ill-conditioned: {conditioning(case, seed)}; {evidence}, and the {reference.precision} difference "
            f"(margin {comparison.margin:.3g} against {comparison.tolerance}) is the runs' own rounding: they stray "
            f"from their float64 shadows by up to {ref_noise:.3g} (reference) and {cand_noise:.3g} (regime)")
    return Comparison(comparison.tolerance, (), (), comparison.max_abs, comparison.max_rel, margin, note=note)


def settled_as_it_trained(case: Case, comparison: Comparison, reference: RunResult, candidate: RunResult,
                          shadow_reference: Callable[[], RunResult],
                          shadow_candidate: Callable[[Expected], RunResult], *, seed: int,
                          shadow_initial: Callable[[], dict[str, Tensor]] | None = None) -> Comparison | None:
    """:func:`judge` for a candidate compared as it trained, which keeps nothing: its float64 shadow is compared with
    the reference's as it trains too. Where the float64 runs match and start where the low-precision runs did, the
    verdict :func:`judge` gives (equivalent), its margin the float64 runs' (the candidate's own rounding was not kept
    to weigh), its note the reference's noise; else None, and the candidate is trained again, recorded, for
    :func:`judge` and the breakdown. A model of hundreds of millions of parameters so holds one low-precision and one
    float64 recording, not two of each, and trains its candidate once."""
    try:
        ref64 = shadow_reference()
        cand64 = shadow_candidate(Expected(ref64, tolerance_of(ref64)))
    except Exception:  # noqa: BLE001 (judge, on the recorded runs, says why the shadows could not weigh it)
        return None
    alike = maths_alike(compare(ref64, cand64), ref64, cand64, shadow_initial)
    if alike is None or any(_start_gap(run, shadow, comparison.tolerance) is not None
                            for run, shadow in ((reference, ref64), (candidate, cand64))):
        return None
    ref_noise = max((float((as_real(own).double() - as_real(exact).double()).abs().max())
                     for _, own, exact in _quantities(reference, reference, ref64) if own.numel()), default=0.0)
    note = (f"ill-conditioned: {conditioning(case, seed)}; {alike[0]}, compared as they trained, and the "
            f"{reference.precision} difference (margin {comparison.margin:.3g} against {comparison.tolerance}) is the "
            f"runs' own rounding: the reference strays from its float64 shadow by up to {ref_noise:.3g}")
    return Comparison(comparison.tolerance, (), (), comparison.max_abs, comparison.max_rel, alike[1], note=note)


def maths_alike(maths: Comparison, ref64: RunResult, cand64: RunResult,
                initial: Callable[[], dict[str, Tensor]] | None) -> tuple[str, float] | None:
    """Whether the float64 shadows (compared: ``maths``) do the same maths, said with their margin; None where they do not. They do where
    they match, or (``initial`` given) where they are apart only in end weights whose true gradient is zero and
    which each moved from where it started by float64's own rounding, amplified (witness.rounding_alone): an
    attention LM's key bias under Adam without epsilon, whose float64 gradient is noise of 1e-17 that the update
    makes a whole step of. Every gradient the shadows computed must match: a fault that changes any real gradient
    is the maths'."""
    if maths.ok:
        return f"the float64 runs match (margin {maths.margin:.3g})", maths.margin
    explained = None if initial is None else witness.rounding_alone(maths, ref64, cand64, initial)
    if explained is None:
        return None
    noises, margin = explained
    return (f"the float64 runs match, but for weights float64's own rounding moves ({noises})",
            margin)


def _start_gap(run: RunResult, shadow: RunResult, tol: Tolerance) -> str | None:
    """How the step-0 losses differ, where the shadow evidently trained from other weights or data."""
    first, again = (r.losses[0] if r.losses else None for r in (run, shadow))
    if first is None or again is None or abs(first - again) <= tol.atol + tol.rtol * abs(again):
        return None
    return f"{first:.6g} vs {again:.6g}"


def _noise_margin(reference: RunResult, candidate: RunResult, ref64: RunResult, cand64: RunResult,
                  tol: Tolerance) -> tuple[float, float, float]:
    """The greatest ``|candidate - reference| / (allowed + noise)`` over every element, where ``noise``
    is how far the two runs stray from their shadows on that quantity (that step's gradient of that
    parameter, a final weight, the loss series); and each run's greatest noise. A complex quantity's real and
    imaginary parts are elements of their own, as compare.py judges them."""
    margin = ref_noise = cand_noise = 0.0
    for (actual, expected, exact), (_, own, own_exact) in zip(_quantities(reference, candidate, ref64),
                                                              _quantities(candidate, candidate, cand64)):
        if not expected.numel():
            continue
        actual, expected, exact, own, own_exact = (as_real(t).double()
                                                   for t in (actual, expected, exact, own, own_exact))
        noise_ref = float((expected - exact).abs().max())
        noise_cand = float((own - own_exact).abs().max())
        allowed = tol.atol + tol.rtol * expected.abs() + noise_ref + noise_cand
        gap = (actual - expected).abs()
        ratio = torch.where(gap == 0, 0.0, gap / allowed)  # equal is 0 even where nothing is allowed
        margin, ref_noise, cand_noise = (max(margin, float(ratio.max())), max(ref_noise, noise_ref),
                                         max(cand_noise, noise_cand))
    return margin, ref_noise, cand_noise


def _quantities(reference: RunResult, candidate: RunResult,
                shadow: RunResult) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(candidate's, reference's, shadow's) of every quantity compared: each step's gradient of each
    parameter, each final weight and buffer, and the loss series."""
    for ref, cand, exact in zip(reference.grads, candidate.grads, shadow.grads):
        for name in ref:
            yield cand[name], ref[name], exact[name]
    for ref, cand, exact in ((reference.weights, candidate.weights, shadow.weights),
                             (reference.buffers, candidate.buffers, shadow.buffers)):
        for name in ref:
            yield cand[name], ref[name], exact[name]
    series = [(r, c, s) for r, c, s in zip(reference.losses, candidate.losses, shadow.losses) if None not in (r, c, s)]
    if series:
        ref, cand, exact = (torch.tensor(values, dtype=torch.float64) for values in zip(*series))
        yield cand, ref, exact


def conditioning(case: Case, seed: int) -> str:
    """Why this case turns rounding into visible differences, as far as its model's modules and its optimizer's class
    show: read from the model built on the meta device where its factory allows (:meth:`Case.skeleton`)."""
    with seeded(seed):
        model, optimizer = _built(case)
    causes = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) and math.prod(module.normalized_shape) <= FEW_FEATURES:
            causes.append(f"LayerNorm over {_count(math.prod(module.normalized_shape), 'feature')}")
        elif isinstance(module, nn.GroupNorm) and module.num_channels // module.num_groups <= FEW_FEATURES:
            causes.append(f"GroupNorm over {_count(module.num_channels // module.num_groups, 'channel')} per group")
    cause = f"{', '.join(dict.fromkeys(causes))}: gradients at rounding level" if causes else "rounding noise"
    if isinstance(optimizer, ADAPTIVE):
        cause += f", amplified by {type(optimizer).__name__} (it scales each update to about its learning rate)"
    return cause


def _built(case: Case) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The case's model and optimizer, on the meta device where both factories build there (an optimizer factory may
    refuse meta parameters), else for real."""
    model = case.skeleton()
    if model is not None:
        try:
            return model, case.build_optimizer(model)
        except Exception:  # noqa: BLE001 (built for real below, where a real error says itself)
            pass
    model = case.model()
    return model, case.build_optimizer(model)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
