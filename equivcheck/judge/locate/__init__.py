"""Where a failed run parts from its reference: the first optimizer step, the phase of that step and the module.

A comparison lists every quantity that differs; most differ only because something before them did. This package
names the one place the difference starts, from two traces of the first step that parts (the reference's and the
candidate's, one per rank: :mod:`equivcheck.runners.tracing`), each record made whole first: micro-batches' and
ranks' rows joined along the dimension where they add up to the reference's, repeated ranks (a tensor-parallel
group sees one batch) counted once, and the activation gradients of ranks whose gradients are averaged divided by
their count (each rank's loss is that many times its share). Phases are tried in the order a step runs them:

- ``state`` / ``optimizer``: the weights at the start of the step already differ: the previous step's update (or
  the optimizer's settings carried to it) parted;
- ``forward``: the first module, in the order forwards finish (a child before its parent), whose inputs match
  and whose output does not;
- ``loss``: every output matches, the gradient of the loss with respect to the model's output does not;
- ``backward``: the first module, in the order backward reaches its inputs, whose output gradient matches and
  whose input gradient, or what backward delivered to its own parameters, does not;
- ``communication`` / ``gradient``: backward delivered the reference's gradients, the optimizer read others:
  ranks that read different ones (or a count of collectives that is off) never reduced them, else something
  changed them after backward (clipping, a hook, scaling, zeroing).

A record that cannot be made whole (a tensor-parallel shard, a module called another number of times) is left out,
never guessed at: the next record decides. Each comparison is judged at the check's own tolerance.

Each reading lives in a module of its own (``carried``, ``forward``, ``loss``, ``backward``, ``after_backward``), over
the records both runs made whole (``records``); ``walk`` tries them in a step's order, ``replayed`` makes the traces
they read (and says where a compiled run parts), ``told`` keeps what a walk was shown of each module. This module
decides which step is walked.
"""

from __future__ import annotations

import dataclasses

from ...diff import Comparison, Location, ProblemKind, kind_of
from .. import noise_floor
from ...precision import Tolerance
from ...result import RunResult
from .records import module_of
from .replayed import Replay, ReplayDiffers, Replayed


def locate(comparison: Comparison, reference: RunResult, candidate: RunResult, replay: Replay,
           repeat_apart: float = 0.0) -> Location | None:
    """Where ``candidate`` first parts from ``reference``, from what the comparison shows and from ``replay(steps)``:
    both runs again, those steps traced, once: the first step whose gradients differ and the one before it (whose
    update may be where it parted), or the last step where only the final state differs; at a float64 check, an
    earlier step where the run parts already under the verdict's tolerance (judge/noise_floor.py; ``repeat_apart``:
    how far the reference's repeat was from it). None where neither says."""
    if comparison.ok:
        return None
    found = _at_tolerance(comparison, reference, candidate, replay)
    if found is None:
        return None

    def walk(step: int, tolerance: Tolerance) -> Location | None:
        try:
            at_floor = dataclasses.replace(comparison, tolerance=tolerance)
            return Replayed(at_floor, reference, candidate, replay, (step,)).walk(step)
        except ReplayDiffers:  # the replay does not train as the run did at that floor: nothing is said there
            return None
    return noise_floor.earlier(found, comparison, reference, candidate, repeat_apart, walk) or found


def _at_tolerance(comparison: Comparison, reference: RunResult, candidate: RunResult,
                  replay: Replay) -> Location | None:
    """Where ``candidate`` first parts from ``reference`` at the verdict's tolerance."""
    counted = _step_count(reference, candidate)
    grads = [m for m in comparison.mismatches if m.kind == "grad" and m.first_step is not None
             and (counted is None or m.first_step < counted.step)]
    if counted is not None and not grads:
        return counted  # else the run parted before its step count did: where, the trace of that step says
    if grads:
        step = min(m.first_step for m in grads)
        traced = Replayed(comparison, reference, candidate, replay, (step - 1, step) if step else (0,))
        found = traced.walk(step)
    else:
        found = _after_the_gradients(comparison, reference, candidate)
        traced = None if found is None else Replayed(comparison, reference, candidate, replay, (found.step,))
    if found is not None and found.phase == "optimizer":
        # the update parted: with the optimizer's own code, or with what it carried into that step?
        return traced.walk(found.step, state_only=True) or found
    return found


def _step_count(reference: RunResult, candidate: RunResult) -> Location | None:
    """A run that stepped its optimizer another number of times parts at the first batch whose count is off."""
    if reference.optimizer_steps == candidate.optimizer_steps:
        return None
    counts = candidate.steps_per_batch or ()
    batch = next((index for index, count in enumerate(counts) if count != 1), 0)
    if counts and counts[batch] == 0 and _loss_at(candidate, batch) is None and _loss_at(reference, batch) is not None:
        return Location(batch, "forward", "", "the batch the model was fed", None,
                        f"it trained on none of global batch {batch} (no loss, no step), the reference on all of it: "
                        "its data ran out or was skipped")
    taken = f"{counts[batch]} times" if counts else f"{candidate.optimizer_steps} times in all"
    return Location(batch, "optimizer", "", f"the optimizer's step count (it stepped {taken} on global batch {batch}, "
                                            f"the reference once a batch)")


def _loss_at(run: RunResult, batch: int) -> float | None:
    """The loss ``run`` reported for global ``batch``; None where it trained nothing on it (or reported none)."""
    return run.losses[batch] if batch < len(run.losses) else None


def _after_the_gradients(comparison: Comparison, reference: RunResult, candidate: RunResult) -> Location | None:
    """A run whose every gradient matched: its loss, its update, what it carries or what it communicated parts."""
    last = max(reference.optimizer_steps - 1, 0)
    by_kind = {}
    for mismatch in comparison.mismatches:
        by_kind.setdefault(mismatch.kind, mismatch)
    communication = [p for p in comparison.problems if kind_of(p) in (ProblemKind.COMMUNICATION, ProblemKind.RANK_DRIFT)]
    if "weight" in by_kind:
        order = list(reference.weights)
        first = min((m for m in comparison.mismatches if m.kind == "weight"),
                    key=lambda m: order.index(m.name) if m.name in order else len(order))
        return Location(last, "optimizer", module_of(first.name), f"weight {first.name!r} after the step",
                        first.diff.margin, "every gradient the optimizer read matches")
    if "buffer" in by_kind:
        buffer = by_kind["buffer"]
        return Location(last, "state", module_of(buffer.name), f"buffer {buffer.name!r}", buffer.diff.margin,
                        "every gradient and weight matches")
    if "loss" in by_kind:
        loss = by_kind["loss"]
        return Location(loss.first_step or 0, "loss", "", "the reported loss", loss.diff.margin,
                        "every gradient and weight matches")
    if communication:
        return Location(_problem_step(communication[0]), "communication", "", "what it communicated", None,
                        str(communication[0]))
    return None


def _problem_step(problem: str) -> int:
    """The step a communication problem names (``communication: step 1 ...``), else 0."""
    words = problem.split()
    return next((int(after) for word, after in zip(words, words[1:]) if word == "step" and after.isdigit()), 0)
