"""Where a failed run parts from its reference: the first optimizer step, the phase of that step and the module.

A comparison lists every quantity that differs; most differ only because something before them did. This module
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
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..diff import COMPUTED_IN, Comparison, Location, ProblemKind, TensorDiff, kind_of
from . import noise_floor
from .hints import factor_of
from ..precision import Tolerance
from ..result import RunResult
from ..trace import ModuleCall, StepTrace

# both runs again with steps traced: (steps, whether the modules' calls are recorded too, whether torch.compile's code
# runs uncompiled: True, the eager twin; or the modules named, each uncompiled inside the compiled code) ->
# (reference, candidate)
Replay = Callable[[tuple[int, ...], bool, bool | tuple[str, ...]], tuple[RunResult, RunResult]]

# the most replays spent narrowing the compiler's location to one module (each with one module alone compiled)
NARROWING_REPLAYS = 24


# the argument that judges a run under the precision its modules computed in
JUDGED_IN = {"bfloat16": 'dtype="bf16-autocast"', "float16": 'dtype="fp16-autocast"', "float32": "dtype=torch.float32"}

UNSEEN = "not recorded in the run (replaced during the step, compiled, or not called)"


class Told:
    """What a walk was shown of each module it passed, in its order: alike (every call of it compared and computed
    alike from what the reference's was given), given otherwise (compared: what it was handed differs, which the code
    around it made), or unseen with why (not recorded, not told). A module the walk never reached is unseen too."""

    def __init__(self) -> None:
        self._unseen: dict[str, str] = {}
        self._given_otherwise: set[str] = set()
        self._alike: set[str] = set()

    def alike(self, module: str) -> None:
        self._alike.add(module)

    def given_otherwise(self, module: str) -> None:
        self._given_otherwise.add(module)

    def unseen(self, module: str, why: str) -> None:
        self._unseen.setdefault(module, why)

    def seen(self, module: str) -> bool:
        return module not in self._unseen and (module in self._alike or module in self._given_otherwise)

    def is_alike(self, module: str) -> bool:
        return self.seen(module) and module not in self._given_otherwise

    def why(self, modules: list[str]) -> dict[str, list[str]]:
        """``modules`` grouped by why each was not seen."""
        grouped: dict[str, list[str]] = {}
        for module in modules:
            grouped.setdefault(self._unseen.get(module, "not reached before it"), []).append(module)
        return grouped


def _shown(modules: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in modules[:4]) + (", ..." if len(modules) > 4 else "")


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
            return _Replayed(at_floor, reference, candidate, replay, (step,)).walk(step)
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
        traced = _Replayed(comparison, reference, candidate, replay, (step - 1, step) if step else (0,))
        found = traced.walk(step)
    else:
        found = _after_the_gradients(comparison, reference, candidate)
        traced = None if found is None else _Replayed(comparison, reference, candidate, replay, (found.step,))
    if found is not None and found.phase == "optimizer":
        # the update parted: with the optimizer's own code, or with what it carried into that step?
        return traced.walk(found.step, state_only=True) or found
    return found


class ReplayDiffers(Exception):
    """A replay did not train as the run it replays did (code whose behaviour the hooks change, a step that keeps
    state across runs): its records say nothing about that run, so no location is said."""


class _Replayed:
    """Both runs replayed once with ``steps`` traced (on first use), walked step by step; each replay in one process
    held to the run it replays first: the gradients its optimizer read at the step must be the run's (where the run
    recorded them). Replays whose module hooks change how they train (a compiled step that traces the hooks) are
    replayed again with the parameters and the optimizer traced alone; where that too trains otherwise, or where
    modules went unrecorded (compiled away), as the run's eager twin (torch.compile's code left uncompiled, from the
    same state): an eager twin that trains as the run did is walked as any eager run; one that trains as the
    reference did, where the compiled replay did not, says the compiled code is where the run parts."""

    def __init__(self, comparison: Comparison, reference: RunResult, candidate: RunResult, replay: Replay,
                 steps: tuple[int, ...]) -> None:
        self.comparison, self.steps, self.recorded = comparison, steps, (reference, candidate)
        self._runs = functools.cache(lambda modules, eager=False: replay(steps, modules, eager))  # eager: Replay's

    def walk(self, step: int, state_only: bool = False) -> Location | None:
        try:
            ours, theirs = self._traced(step, modules=True)
        except ReplayDiffers as hooked:
            try:
                ours, theirs = self._traced(step, modules=False)
            except ReplayDiffers:
                return self._eager_twin(step, state_only, hooked)
            # its modules unrecorded, a location is read from its parameters alone: the eager twin may say more
            found = self._walked(ours, theirs, step, state_only)
            return self._eager_twin(step, state_only, None, held=False, seen=found) or found
        found = self._walked(ours, theirs, step, state_only)
        if found is not None and _outside_modules(found):
            return self._eager_twin(step, state_only, None, held=True, seen=found) or found
        return found

    def _walked(self, ours: list[StepTrace], theirs: list[StepTrace], step: int, state_only: bool,
                how: str = "") -> Location | None:
        if not ours or not theirs:
            return None
        walk = _Walk(ours[0], theirs, self.comparison, step)
        found = walk.carried_into() if state_only else walk.first()
        forwards = sum(call.module == "" for call in theirs[0].calls) or None
        return None if found is None else dataclasses.replace(
            found, forwards=forwards, matched="; ".join(filter(None, (found.matched, how))))

    def _compiled(self, step: int, modules: bool = False) -> bool:
        """Whether the run's replay (with its modules hooked, or its parameters alone) and its eager twin read other
        gradients at ``step``: torch.compile's code computes otherwise than the same code uncompiled."""
        compiled = [t for t in self._runs(modules)[1].traces if t.step == step]
        eager = [t for t in self._runs(True, True)[1].traces if t.step == step]
        if not compiled or len(compiled) != len(eager):
            return False
        return any(name not in theirs.read or not torch.equal(read, theirs.read[name])
                   for ours, theirs in zip(compiled, eager) for name, read in ours.read.items())

    def _eager_twin(self, step: int, state_only: bool, hooked: ReplayDiffers | None,
                    held: bool | None = None, seen: Location | None = None) -> Location | None:
        """Where the run parts, read from its eager twin; ``hooked``: why its compiled replays say nothing (raised
        again where the eager twin does not say either); ``held``: whether the replay held to the run hooked its
        modules (True) or its parameters alone (False), where one was: a twin that reads what it read says nothing
        more (the run compiled nothing that computes otherwise); ``seen``: where that replay first parts, if it
        says."""
        if held is not None and not self._compiled(step, held):
            return None
        try:
            ours, theirs = self._traced(step, modules=True, eager=True)
            return self._walked(ours, theirs, step, state_only,
                                "replayed as its eager twin (torch.compile off, from the same state): it parts "
                                "there too")
        except ReplayDiffers:
            pass
        reference, candidate = self._runs(True, True)
        theirs = [trace for trace in candidate.traces if trace.step == step]
        if len(theirs) == 1 and self._compiled(step, bool(held)) and self._reads_the_references(theirs[0], step):
            module, said = self._compiled_alone(step, theirs[0])
            return Location(step, "compiler", module, "the compiled code", None,
                            f"its eager twin (torch.compile off, from the same state) reads the reference's gradients "
                            f"at step {step}, its compiled replay other ones: the compiled code computes otherwise "
                            "than the code it was compiled from" + (
                                "" if seen is None else f" (its compiled replay first differs at {seen.tensor})")
                            + said)
        if hooked is not None:
            raise hooked  # it trains otherwise however it is replayed: state kept across runs
        return None

    def _reads_the_references(self, trace: StepTrace, step: int) -> bool:
        """Whether ``trace`` read, at ``step``, every gradient the reference recorded there, as it recorded it."""
        recorded = self.recorded[0].grads[step] if step < len(self.recorded[0].grads) else {}
        return bool(recorded) and recorded.keys() <= trace.read.keys() and \
            not _not_as_recorded(self.recorded[0], trace, step, self.comparison.tolerance)

    def _compiled_alone(self, step: int, twin: StepTrace) -> tuple[str, str]:
        """The narrowest module whose compiled form alone makes the run part at ``step``, as torch's accuracy
        minifier narrows a graph: every other module of the model run uncompiled (a graph break around each), from
        the model's children down, in the order the eager ``twin`` called them. A module's own code (its children
        uncompiled too) that parts is where it stops; "" where it is the model's own code between its modules (or
        code outside them), or where no module alone parts (the difference needs several compiled together); with
        what was said of it."""
        called = list(dict.fromkeys(call.module for call in twin.calls if call.module))
        if not called:
            return "", ""  # no module of the model recorded: none to narrow it to
        children = {parent: [name for name in called if module_of(name) == parent] for parent in ("", *called)}

        def uncompiled(module: str, own: bool) -> tuple[str, ...]:
            """Every module but ``module`` (and the ancestors whose code calls it): its siblings and theirs; and its
            children, where only its ``own`` code stays compiled."""
            path = [module, *_ancestors(module)] if module else [""]
            others = [name for inner in path[:-1] for name in children[module_of(inner)] if name != inner]
            return tuple(sorted(others + (children[module] if own else [])))

        tried = 0

        def parts(left_uncompiled: tuple[str, ...]) -> bool:
            nonlocal tried
            tried += 1
            theirs = [t for t in self._runs(False, left_uncompiled)[1].traces if t.step == step]
            return len(theirs) == 1 and bool(theirs[0].read) and not self._reads_the_references(theirs[0], step)

        found = ""
        while tried < NARROWING_REPLAYS:
            if parts(uncompiled(found, own=True)):
                return found, ("; compiled alone (every other module of the model uncompiled), " + (
                    f"`{found}`'s own code (its children uncompiled too)" if found else
                    "the model's own code between its modules (or code outside them)") + " makes the run part")
            child = next((child for child in children[found] if tried < NARROWING_REPLAYS
                          and parts(uncompiled(child, own=False))), None)
            if child is None:
                break
            found = child
        if tried >= NARROWING_REPLAYS:
            return found, f"; {tried} replays spent narrowing it to one module compiled alone, {found or 'none'} so far"
        return found, ("; " + (f"`{found}` compiled alone makes the run part" if found else "no module") +
                       (", and none of its children compiled alone does" if found else
                        " of the model compiled alone makes the run part: it parts where several are compiled "
                        "together"))

    def _traced(self, step: int, modules: bool, eager: bool = False) -> tuple[list[StepTrace], list[StepTrace]]:
        """The reference's and the candidate's traces of ``step`` (each rank's), from replays held to their runs."""
        reference, candidate = self._runs(modules, eager)
        theirs = [trace for trace in candidate.traces if trace.step == step]
        ours = [trace for trace in reference.traces if trace.step == step]
        for run, traces, which in ((self.recorded[0], ours, "reference"), (self.recorded[1], theirs, "run")):
            if len(traces) != 1:  # a rank's own read is no whole gradient (a shard, a partial sum): not held to it
                continue
            apart = _not_as_recorded(run, traces[0], step, self.comparison.tolerance)
            if apart:
                hooked = "as its eager twin" if eager else "with hooks" if modules else \
                    "with its parameters hooked alone"
                raise ReplayDiffers(f"replayed {hooked}, the {which} read another gradient of {apart} at step {step} "
                                    "than it did: its records would not say where it parted")
        return ours, theirs


def _outside_modules(found: Location) -> bool:
    """Whether a location names code no module hook saw: a module not recorded, or the code between modules (where
    a compiled step's code may be what parts)."""
    return UNSEEN in found.matched or (found.phase in ("forward", "backward") and not found.module)


def _not_as_recorded(run: RunResult, trace: StepTrace, step: int, tol: Tolerance) -> str:
    """The first parameter whose gradient ``trace`` read at ``step`` is not the one ``run`` recorded there (where it
    recorded one, whole as the trace holds it), quoted; "" where they agree."""
    recorded = run.grads[step] if step < len(run.grads) else {}
    for name, grad in recorded.items():
        read = trace.read.get(name)
        if read is not None and read.shape == grad.shape and TensorDiff.of(read, grad, tol).margin > 1:
            return repr(name)
    return ""


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


def module_of(name: str) -> str:
    """The module that holds parameter (or buffer) ``name``: ``'blocks.1.fc2'`` of ``'blocks.1.fc2.weight'``."""
    return name.rpartition(".")[0]


class _Walk:
    """The phases of one traced step, tried in order against the reference's trace."""

    def __init__(self, reference: StepTrace, ranks: Sequence[StepTrace], comparison: Comparison, step: int) -> None:
        self.reference, self.step, self.comparison = reference, step, comparison
        self.tol: Tolerance = comparison.tolerance
        self.ranks = list(ranks)
        self.distinct = _distinct_data(self.ranks)  # the ranks that hold shards of their own, in order
        # a pipeline's stages (every rank one stage where no pipeline cuts the model), each with the modules it ran:
        # a module's records are joined over the ranks of its own stage, each rank a data-parallel replica there
        self.stages = _stages(self.distinct)
        self.staged = [{call.module for trace in stage for call in trace.calls} for stage in self.stages]
        self.averaged = len(self.stages[0])
        # each run's activation gradients and what backward delivered, divided by its loss scale (a GradScaler's)
        self.scale = self.distinct[0].loss_scale * self.averaged
        self.reference_scale = reference.loss_scale
        self.calls = {}
        for call in reference.calls:
            self.calls.setdefault(call.module, []).append(call)
        # modules whose own parameters ranks fed one batch hold other parts of (tensor parallelism): their outputs and
        # gradients are shards or partial sums, which no join makes whole. Parts held by ranks each fed data of their
        # own (FSDP2, ZeRO) are storage only: those ranks compute whole modules, and their records join as DDP's do.
        self.held_in_parts = {name for trace in self.ranks for name, grad in trace.read.items()
                              if name in reference.read and grad.shape != reference.read[name].shape}
        self.sharded = {module_of(name) for name in self.held_in_parts if not self._sharded_for_storage(name)}
        self.layout = self._layout()

    def first(self) -> Location | None:
        for phase in (self._carried, self._buffers_carried, self._forward, self._loss, self._backward,
                      self._after_backward):
            found = phase()
            if found is not None:
                return found
        return None

    # -- what the step started from
    def _carried(self) -> Location | None:
        if self.step == 0:
            return None
        before, theirs = self.reference.weights_before, self.ranks[0].weights_before
        for name, expected in before.items():
            diff = self._diff(theirs.get(name), expected)
            if diff is None or diff.margin <= 1:
                continue
            settings = self._settings_apart()
            if settings:
                return Location(self.step - 1, "state", "", settings, None,
                                f"the optimizer's settings carried into step {self.step} differ")
            return Location(self.step - 1, "optimizer", module_of(name), f"weight {name!r} after the step",
                            diff.margin, f"every gradient the optimizer read at step {self.step - 1} matches")
        return None

    def _buffers_carried(self) -> Location | None:
        """A buffer, persistent or not, that the step began with otherwise while its weights match (a resume whose
        checkpoint left it out, code that resets it): ``state`` in the module holding it, whatever its forward shows
        later. The weights it began from are held first (``_carried``)."""
        theirs = self.ranks[0].buffers_before
        for name, expected in self.reference.buffers_before.items():
            actual = theirs.get(name)
            if actual is None:
                continue  # a buffer only the reference's modules hold: not seen in the run
            diff = self._diff(actual, expected)
            if diff is not None and diff.margin > 1:
                return Location(self.step, "state", module_of(name), f"buffer {name!r} as the step began",
                                diff.margin, f"the weights step {self.step} began from match; what else carried into "
                                "it differs")
        return None

    def _settings_apart(self) -> str:
        for group, (expected, actual) in enumerate(zip(self.reference.hyper, self.ranks[0].hyper)):
            for key, value in expected.items():
                if key in actual and not _close(actual[key], value):
                    return f"the optimizer's {key} of parameter group {group} ({actual[key]:.6g}, the reference's {value:.6g})"
        return ""

    def carried_into(self) -> Location | None:
        """What the step began with besides the weights, where it differs: the optimizer's settings (a schedule) or
        its state (moments, momentum, step counts: a resume that lost them); None where the weights it began from
        differ already, or nothing else does."""
        theirs = self.ranks[0].weights_before
        if any((diff := self._diff(theirs.get(name), expected)) is not None and diff.margin > 1
               for name, expected in self.reference.weights_before.items()):
            return None
        settings = self._settings_apart()
        if settings:
            return Location(self.step, "state", "", settings, None, f"the weights step {self.step} began from match")
        theirs = self.ranks[0].optimizer_state
        for key, expected in self.reference.optimizer_state.items():
            actual = theirs.get(key)
            diff = self._diff(actual, expected)
            if (actual is None and expected.count_nonzero()) or (diff is not None and diff.margin > 1):
                name = key.rpartition("/")[0]
                return Location(self.step, "state", module_of(name), f"the optimizer's state {key!r}",
                                None if diff is None else diff.margin, f"the weights step {self.step} began from match")
        for key, actual in theirs.items():  # state the reference has not made yet (a step taken before training)
            if key not in self.reference.optimizer_state and actual.count_nonzero():
                return Location(self.step, "state", module_of(key.rpartition("/")[0]), f"the optimizer's state "
                                f"{key!r}", None, f"the weights step {self.step} began from match; the reference "
                                "held no such state then")
        return None

    # -- the forward
    def _forward(self) -> Location | None:
        """Where the forward parts: in the precision the run computed in where that is not the reference's (a wrap's
        or the step's own policy: no module's code is then told), else at the first module that computes otherwise."""
        found = self._forward_calls()
        if found is not None and found.phase == "forward":
            return self._computed_otherwise() or found
        return found

    def _computed_otherwise(self) -> Location | None:
        """The modules whose outputs the run computed in another dtype than the reference's did, as a location: the
        run's precision, held by the narrowest module that holds them all."""
        def dtypes(traces: Sequence[StepTrace]) -> dict[str, set[str]]:
            found: dict[str, set[str]] = {}
            for trace in traces:
                for call in trace.calls:
                    if call.computed_in:
                        found.setdefault(call.module, set()).add(call.computed_in)
            return found

        ours, theirs = dtypes([self.reference]), dtypes(self.ranks)
        apart = sorted(module for module in ours if module in theirs and theirs[module] != ours[module])
        if not apart:
            return None
        run = sorted({d.removeprefix("torch.") for module in apart for d in theirs[module]})
        reference = ", ".join(sorted({d.removeprefix("torch.") for module in apart for d in ours[module]}))
        judged = " or ".join(JUDGED_IN[dtype] for dtype in run if dtype in JUDGED_IN)
        named = _shown([module for module in apart if module]) or "the model"  # the root's follows its children's
        return Location(self.step, "forward", _common_ancestor(apart), COMPUTED_IN,
                        None, f"{named} computed in {', '.join(run)}, the reference's in {reference}: the run's "
                        "precision (a wrap's MixedPrecisionPolicy, autocast or a cast in the step), not a module's "
                        f"code; {f'judge it under that precision ({judged}) or ' if judged else ''}give the "
                        "reference the same precision")

    def _forward_calls(self) -> Location | None:
        fed = self._fed_otherwise()
        if fed is not None:
            return fed
        fed_apart: tuple[ModuleCall, ModuleCall] | None = None  # the first call fed otherwise after clean ones
        clean = True  # every call so far told whole, and computed alike from the same inputs
        told = Told()
        for call in self.reference.calls:
            theirs = self._joined_call(call)
            if theirs is None:
                told.unseen(call.module, UNSEEN)
                clean = False
                continue
            if not self._same_inputs(theirs, call):
                told.given_otherwise(call.module)
                if clean:
                    fed_apart = (call, theirs)
                clean = False
                continue  # its inputs differ already (or cannot be told): a module before it parted
            for position, (actual, expected) in enumerate(zip(theirs.outputs, call.outputs)):
                diff = self._diff(actual, expected)
                clean = clean and diff is not None  # an output that cannot be told may differ
                if diff is None:
                    told.unseen(call.module, "its output could not be told")
                if diff is not None and diff.margin > 1:
                    if _drew_otherwise(theirs, call):
                        return Location(self.step, "state", "", f"the random state {_named(call)} drew from", None,
                                        f"its inputs match; the random generator's state it began from is not the "
                                        f"reference's: the random stream carried into step {self.step} differs")
                    children, own_code = self._children_told(call.module, "their inputs", told)
                    return Location(self.step, "forward", call.module, f"{_nth('output', position, call.outputs)} of "
                                    f"{_named(call)}", diff.margin, "its inputs match" + children, own_code)
            told.alike(call.module)
        return None if fed_apart is None else self._fed_by_its_caller(*fed_apart)

    def _fed_by_its_caller(self, call: ModuleCall, theirs: ModuleCall) -> Location | None:
        """A call whose input differs while every call before it computed alike from the same inputs: the input was
        made between modules, in the code that calls it: its nearest ancestor the step ran (else its parent, whose
        methods call it; the team's step where that is the root)."""
        for position, (actual, expected) in enumerate(zip(theirs.inputs, call.inputs)):
            diff = self._diff(actual, expected)
            if diff is None or diff.margin <= 1:
                continue
            parent = call.module.rpartition(".")[0]
            caller = next((name for name in _ancestors(call.module) if name in self.calls), parent)
            code = f"`{caller}`'s own code" if caller else "the code that calls it (the model's or the team's step)"
            return Location(self.step, "forward", caller, f"{_nth('input', position, call.inputs)} of "
                            f"{_named(call)}", diff.margin, f"every module that ran before it computes alike from "
                            f"the same inputs: its input is made in {code}", bool(caller))
        return None

    def _same_inputs(self, theirs: ModuleCall, call: ModuleCall) -> bool:
        """Whether a call's floating inputs match within tolerance and its integer ones (token ids) exactly."""
        floats = [self._diff(a, e) for a, e in zip(theirs.inputs, call.inputs)]
        return all(d is not None and d.margin <= 1 for d in floats) and all(
            a is not None and a.shape == e.shape and torch.equal(a, e) for a, e in zip(theirs.integers, call.integers))

    def _fed_otherwise(self) -> Location | None:
        """The model called whole in both runs, but with rows that do not make up the global batch's (a sampler that
        pads or drops, ranks handed the same shard): the difference is in what it was fed, before any module."""
        root = self.calls.get("", [None])[0]
        if root is None or "" in self.sharded or \
                not all(any(c.module == "" for c in trace.calls) for trace in self.distinct):
            return None
        theirs = self._joined_call(root)
        if theirs is not None and self._same_inputs(theirs, root):
            return None
        return Location(self.step, "forward", "", "the batch the model was fed", None,
                        "its rows do not make up the global batch's: samples padded, dropped or handed out otherwise")

    # -- the loss
    def _loss(self) -> Location | None:
        theirs = next(filter(None, map(self._joined_call, self._model_output_calls())), None)
        root = self.calls.get("", [None])[0]
        outputs = [] if theirs is None else [self._diff(a, e) for a, e in zip(theirs.outputs, root.outputs)]
        if any(outputs) and all(diff is None or diff.margin <= 1 for diff in outputs):  # those that join match
            pairs = [(self._averaged(actual), self._unscaled(expected))
                     for actual, expected in zip(theirs.grad_outputs, self.calls[""][0].grad_outputs)]
            diffs = [self._diff(actual, expected) for actual, expected in pairs]
            apart = next((diff for diff in diffs if diff is not None and diff.margin > 1), None)
            if apart is not None:
                factors = {None if actual is None or expected is None else factor_of(expected, actual)
                           for actual, expected in pairs if expected is not None}
                factor = factors.pop() if len(factors) == 1 else None
                if factor is not None and not self._read_scaled_by(factor):
                    # a loss scaled by a factor the run divides out of its gradients after backward (a pipeline
                    # schedule's scale_grads): its activation gradients are read without it, as a GradScaler's are
                    self.scale *= factor
                    return None
                return Location(self.step, "loss", "", "the gradient of the loss with respect to the model's "
                                "output", apart.margin, "the model's outputs match")
        loss = next((m for m in self.comparison.mismatches if m.kind == "loss" and m.first_step == self.step), None)
        if loss is not None and not self._grads_differ_here():
            return Location(self.step, "loss", "", "the reported loss", loss.diff.margin, "the model's outputs match")
        return None

    def _read_scaled_by(self, factor: float) -> bool:
        """Whether every gradient the optimizer read whole is the reference's times ``factor``: nothing after backward
        took the factor out."""
        read = [(self.ranks[0].read.get(name), expected) for name, expected in self.reference.read.items()]
        factors = [factor_of(expected, actual) for actual, expected in read
                   if actual is not None and actual.shape == expected.shape and expected.count_nonzero()]
        return all(found is not None and _close(found, factor, 1e-4) for found in factors)

    def _model_output_calls(self) -> list[ModuleCall]:
        """The reference's calls whose outputs are the model's: the model's own, then any module's that returns them
        (a pipeline's last stage runs its last module, never the whole model)."""
        root = self.calls.get("", [None])[0]
        if root is None:
            return []
        return [root] + [call for call in self.reference.calls if call.module and _same(call.outputs, root.outputs)]

    def _grads_differ_here(self) -> bool:
        return any(m.kind == "grad" and m.first_step == self.step for m in self.comparison.mismatches)

    # -- the backward
    def _backward(self) -> Location | None:
        owned = _owned(self.reference.delivered)
        judged: set[str] = set()
        told = Told()
        for module, index in self.reference.backward_order:
            call = next((c for c in self.calls.get(module, ()) if c.index == index), None)
            theirs = None if call is None else self._joined_call(call)
            if call is not None and (theirs is None or module in self.sharded):
                found = self._unreduced(call, None, "grad_inputs")
                if found is not None:
                    return found
            if theirs is None:
                told.unseen(module, UNSEEN)
                continue
            outputs = [self._diff(self._averaged(a), self._unscaled(e))
                       for a, e in zip(theirs.grad_outputs, call.grad_outputs) if e is not None]
            if any(d is None or d.margin > 1 for d in outputs):
                unreduced = self._unreduced(call, max((d.margin for d in outputs if d is not None), default=None))
                if unreduced is not None:
                    return unreduced
                told.given_otherwise(module)
                continue  # its output gradient differs already: the difference came from after it
            children, own_code = self._children_told(module, "their output gradients", told)
            matched = "its output gradient matches" + children
            for position, (actual, expected) in enumerate(zip(theirs.grad_inputs, call.grad_inputs)):
                if expected is None:
                    continue
                diff = self._diff(self._averaged(actual), self._unscaled(expected))
                if diff is None:
                    told.unseen(module, "its input gradient could not be told")
                if diff is not None and diff.margin > 1:
                    return Location(self.step, "backward", module, f"the gradient of "
                                    f"{_nth('input', position, call.inputs)} of {_named(call)}", diff.margin, matched,
                                    own_code)
            if module in judged:
                told.alike(module)
                continue
            judged.add(module)
            for name in owned.get(module, ()):
                if module in self.sharded and name not in self.held_in_parts:
                    continue  # whole-shaped beside parts (a row-parallel bias): each rank's may be a partial sum
                diff = self._diff(self._delivered(name), self._reference_delivered(name))
                if diff is not None and diff.margin > 1:
                    return Location(self.step, "backward", module, f"the gradient backward delivered to {name!r}",
                                    diff.margin, matched, own_code)
            told.alike(module)
        return self._changed_on_its_way() or self._never_summed() or self._by_parameters()

    def _by_parameters(self) -> Location | None:
        """A step traced without its modules' calls (their hooks change how it trains), whose loss matches (its
        forward computed alike): the first parameter, in the order backward delivered to them, whose gradient differs
        while every one delivered before it matches. Backward parts in the module that holds it."""
        loss_parts = any(m.kind == "loss" and m.first_step == self.step for m in self.comparison.mismatches)
        if self.reference.calls or loss_parts:
            return None
        for name in self.reference.delivered:
            diff = self._diff(self._delivered(name), self._reference_delivered(name))
            if diff is None:
                return None  # one that cannot be told: what follows it says nothing
            if diff.margin > 1:
                return Location(self.step, "backward", module_of(name), f"the gradient backward delivered to {name!r}",
                                diff.margin, "the loss and every gradient backward delivered before it match (its "
                                "modules' calls unrecorded: hooked, it trains otherwise)")
        return None

    def _unreduced(self, call: ModuleCall, margin: float | None, sent: str = "grad_outputs") -> Location | None:
        """Ranks fed one batch (a tensor-parallel group) that ran ``call`` on the same inputs, and alike where ``sent``
        says which gradients they exchanged: different gradients for its output (``grad_outputs``; its outputs
        alike too) or sent back for its input (``grad_inputs``; the gradients of its output alike), which add up to
        the reference's: each rank's partial sum, which no collective added up there. None where the records say
        otherwise."""
        alike = ("inputs", "outputs") if sent == "grad_outputs" else ("inputs", "grad_outputs")
        made = self._over_replicas(call)
        if made is None or any(made.apart[field] for field in alike) or not made.apart[sent]:
            return None
        for summed, first, expected in zip(made.summed[sent], made.first[sent], getattr(call, sent)):
            diff = self._diff(self._averaged(summed), self._unscaled(expected))
            if diff is None or diff.margin > 1:
                return None
            own = self._diff(self._averaged(first), self._unscaled(expected))
            margin = max(margin or 0.0, own.margin) if own is not None else margin
        what, it = ("the output", "its output") if sent == "grad_outputs" else (_nth("input", 0, call.inputs), "it")
        told = "was sent another gradient for it" if sent == "grad_outputs" else \
            "sent back another gradient for its input"
        return Location(self.step, "communication", call.module, f"the gradient of {what} of {_named(call)}", margin,
                        f"ranks fed one batch computed {it} alike; {made.apart[sent]} {told} than rank {made.rank}, "
                        "and theirs add up to the reference's: partial sums no collective added up")

    def _over_replicas(self, call: ModuleCall) -> _Replicated | None:
        """``call`` as each rank fed one batch made it, its records joined over micro-batches and data shards; None
        where some rank's calls cannot stand for it, or no two ranks were fed one batch."""
        fields = ("inputs", "outputs", "grad_outputs", "grad_inputs")
        made = _Replicated(apart=dict.fromkeys(fields, ""), first={}, summed={})
        firsts: dict[str, list] = {field: [] for field in fields}
        summed: dict[str, list] = {field: [] for field in fields}
        for shard in self._holders(call.module):
            replicas = [(trace.rank, self._standing_for(trace, call)) for trace in self._replicas(shard)]
            if len(replicas) < 2 or any(calls is None for _, calls in replicas):
                return None
            made.rank = replicas[0][0]
            for pieces in zip(*(calls for _, calls in replicas)):
                for field in fields:
                    records = [getattr(piece, field) for piece in pieces]
                    if any(len(record) != len(records[0]) for record in records):
                        return None
                    for (rank, _), record in zip(replicas[1:], records[1:]):
                        if not made.apart[field] and not self._alike(record, records[0]):
                            made.apart[field] = f"rank {rank}"
                    firsts[field].append(records[0])
                    summed[field].append([None if any(part is None for part in parts) else sum(parts[1:], parts[0])
                                          for parts in zip(*records)])
        for field in fields:
            made.first[field] = [_joined([self._laid_out(record[i], like) for record in firsts[field]], like)
                                 for i, like in enumerate(getattr(call, field))]
            made.summed[field] = [_joined([self._laid_out(record[i], like) for record in summed[field]], like)
                                  for i, like in enumerate(getattr(call, field))]
        return made

    def _alike(self, first: list[Tensor | None], second: list[Tensor | None]) -> bool:
        """Whether two ranks' records of one call agree (an input that is no tensor, alike)."""
        return all((a is None and b is None) or self._alike_parts([b, a]) for a, b in zip(first, second))

    def _never_summed(self) -> Location | None:
        """The first call, in backward order, that ranks fed one batch ran on the same inputs, each sending back its
        own part of its input's gradient (the parts add up to the reference's), where a call that backward reaches
        after it was sent different gradients on those ranks from the same inputs: the parts went on unsummed. (Parts
        its caller's code sums, as Megatron's regions do, leave every call after it sent alike.)"""
        calls = [next((c for c in self.calls.get(module, ()) if c.index == index), None)
                 for module, index in self.reference.backward_order]
        made = [None if call is None else self._over_replicas(call) for call in calls]
        for position, (call, replicas) in enumerate(zip(calls, made)):
            if replicas is None or replicas.apart["inputs"] or not replicas.apart["grad_inputs"]:
                continue
            if not any(later is not None and not later.apart["inputs"] and later.apart["grad_outputs"]
                       for later in made[position + 1:]):
                continue  # nothing after it was sent parts: what it sent back was summed on its way
            for at, (summed, first, expected) in enumerate(zip(replicas.summed["grad_inputs"],
                                                               replicas.first["grad_inputs"], call.grad_inputs)):
                diff = self._diff(self._averaged(summed), self._unscaled(expected))
                own = self._diff(self._averaged(first), self._unscaled(expected))
                if diff is not None and diff.margin <= 1 and own is not None and own.margin > 1:
                    return Location(self.step, "communication", call.module, f"the gradient of "
                                    f"{_nth('input', at, call.inputs)} of {_named(call)}", own.margin,
                                    f"ranks fed one batch ran it on the same inputs; {replicas.apart['grad_inputs']} "
                                    f"sent back another part of its input's gradient than rank {replicas.rank}, the "
                                    "parts add up to the reference's, and what backward reached after it was sent "
                                    "parts too: never summed")
        return None

    def _changed_on_its_way(self) -> Location | None:
        """The first call, in backward order, whose output gradient differs though the modules its output feeds passed
        back the reference's: the gradient changed between them, where no module of the model is recorded (a hook on
        the output, a pipeline stage's own code around its modules). A parent recorded whole is found before this,
        as its own code."""
        for module, index in self.reference.backward_order:
            call = next((c for c in self.calls.get(module, ()) if c.index == index), None)
            theirs = None if call is None else self._joined_call(call)
            if theirs is None:
                continue
            for position, (actual, expected) in enumerate(zip(theirs.grad_outputs, call.grad_outputs)):
                diff = self._diff(self._averaged(actual), self._unscaled(expected))
                if diff is None or diff.margin <= 1:
                    continue
                consumers = self._passed_back_alike(call, position)
                if consumers:
                    return Location(self.step, "backward", module, f"the gradient of "
                                    f"{_nth('output', position, call.outputs)} of {_named(call)}", diff.margin,
                                    f"{consumers} passed back the reference's gradient to it: it changed on its way")
        return None

    def _passed_back_alike(self, call: ModuleCall, position: int) -> str:
        """The modules (quoted) that output ``position`` of ``call`` feeds, where in both runs the gradients they
        passed back to it add up to the reference's gradient of that output (so they account for all of it); "" where
        none does, or they do not."""
        output, expected = call.outputs[position], self._unscaled(call.grad_outputs[position])
        fed = [(other, at) for other in self.reference.calls for at, given in enumerate(other.inputs)
               if given is not None and given.shape == output.shape and torch.equal(given, output)]
        fed = [(other, at) for other, at in fed if not any(_within(other.module, outer.module) for outer, _ in fed)]
        if not fed or any(other.grad_inputs[at] is None for other, at in fed):
            return ""
        theirs = [(self._joined_call(other), at) for other, at in fed]
        if any(joined is None or joined.grad_inputs[at] is None for joined, at in theirs):
            return ""
        for sent in (sum(self._unscaled(other.grad_inputs[at]) for other, at in fed),
                     sum(self._averaged(joined.grad_inputs[at]) for joined, at in theirs)):
            diff = self._diff(sent, expected)
            if diff is None or diff.margin > 1:
                return ""
        return ", ".join(f"`{other.module}`" for other, _ in fed)

    def _children_told(self, module: str, given: str, told: Told) -> tuple[str, bool]:
        """What ``module``'s children (its nearest recorded descendants: a ModuleList's items, not the list) were told,
        and whether the difference is ``module``'s own code: only where every one of them was compared and computed
        alike from the same ``given``. A child the run never recorded (replaced during the step, compiled), fed
        otherwise or that could not be told is named as such, and ``module``'s own code is then not claimed."""
        prefix = f"{module}." if module else ""
        below = {name for name in self.calls if name.startswith(prefix) and name != module}
        children = sorted(name for name in below if not any(
            name.startswith(f"{other}.") for other in below if other != name))
        if not children:
            return "", False
        alike = [name for name in children if told.is_alike(name)]
        otherwise = [name for name in children if told.seen(name) and not told.is_alike(name)]
        unseen = [name for name in children if not told.seen(name)]
        said = f"; its children ({_shown(alike)}) compute alike from {given}" if alike else "; its children"
        if otherwise:
            said += f"{',' if alike else ''} ({_shown(otherwise)}) are handed otherwise, by the code around them"
        if not unseen:
            return said + ": its own code", bool(alike or otherwise)
        reasons = "; ".join(f"{_shown(names)} {why}" for why, names in told.why(unseen).items())
        opening = said + "; " if alike or otherwise else "; "
        return (f"{opening}{reasons}: its own code is not claimed (the difference is in "
                f"{f'`{module}`' if module else 'the model'} or in them)"), False

    def _sharded_for_storage(self, name: str) -> bool:
        """Whether every rank's part of ``name`` has its place in the whole recorded, and no two ranks fed one batch
        hold different parts (which only tensor parallelism does)."""
        if not all(name in trace.placed for trace in self.ranks if name in trace.read):
            return False
        parts = [(trace.root_inputs, trace.placed[name][1]) for trace in self.ranks if name in trace.placed]
        return all(offset == other_offset or not _same(batch, other_batch)
                   for (batch, offset), (other_batch, other_offset) in itertools.combinations(parts, 2))

    def _joined_read(self, name: str, record: str = "read") -> Tensor | None:
        """The gradient of ``name`` the optimizer read (or another ``record`` of its parts), whole: each rank's part
        put in its place (parts held twice, by replicas, overlap); None where ``name`` is held whole, or its parts
        leave some of it uncovered."""
        pieces = [(trace.placed[name], getattr(trace, record)[name]) for trace in self.ranks
                  if name in trace.placed and name in getattr(trace, record)]
        if not pieces:
            return None
        shape = pieces[0][0][0]
        whole, covered = torch.zeros(shape, dtype=pieces[0][1].dtype), torch.zeros(shape, dtype=torch.bool)
        for (_, offset), piece in pieces:
            where = tuple(slice(start, start + size) for start, size in zip(offset, piece.shape))
            whole[where], covered[where] = piece, True
        return whole if bool(covered.all()) else None

    # -- between backward and the update
    def _after_backward(self) -> Location | None:
        """The first parameter, in model order, whose gradient as the optimizer read it differs while there is
        evidence of where it was changed: ranks that hold it whole read it apart (``communication``), or backward
        delivered the reference's gradient to it (``gradient``; ``communication`` where the collectives' count is
        off). A parameter with neither (a shard, a pipeline stage's) is passed over; none left: unsaid."""
        read = [m for m in self.comparison.mismatches if m.kind == "grad" and m.first_step == self.step]
        order = list(self.reference.read)
        counts = [p for p in self.comparison.problems if kind_of(p) is ProblemKind.COMMUNICATION]
        scaled: dict[str, float] = {}  # parts joined, each the reference's times a factor
        read.sort(key=lambda m: order.index(m.name) if m.name in order else len(order))
        for first in read:
            name = first.name
            what = f"grad of {name!r} as the optimizer read it"
            apart = self._ranks_read_apart(name)
            if apart:  # replicas read different gradients: reduced wrong (or never), or each scaled its own after
                if self._read_as_delivered(name):
                    return Location(self.step, "communication", module_of(name), what, first.diff.margin,
                                    f"{apart}: each rank read what its own backward delivered, never reduced")
                if self._scaled_copies(name):
                    return Location(self.step, "gradient", module_of(name), what, first.diff.margin,
                                    f"{apart}: each read the reference's gradient scaled by a factor of its own, after "
                                    "the reduction")
                return Location(self.step, "communication", module_of(name), what, first.diff.margin,
                                f"{apart}: what each read is no reduction of what backward delivered")
            delivered = self._diff(self._delivered(name), self._reference_delivered(name))
            changed = self._changed_after_reduction(name) if delivered is None else ""
            if changed:
                return Location(self.step, "gradient", module_of(name), what, first.diff.margin, changed)
            if delivered is None:
                factor = factor_of(self.reference.read[name], self._joined_read(name)) \
                    if name in self.reference.read else None
                if factor is not None:
                    scaled[name] = factor
                continue
            if delivered.margin > 1:
                return None  # backward delivered another gradient, and no record above could say where: left unsaid
            matched = "backward delivered the reference's gradient to it"
            if self._last_pass_alone(name):
                return Location(self.step, "gradient", module_of(name), what, first.diff.margin,
                                f"{matched} over its backward passes; the optimizer read what the last pass alone "
                                "delivered: the passes before it were dropped (an accumulator reset)")
            if counts:
                return Location(self.step, "communication", module_of(name), what, first.diff.margin,
                                f"{matched}; {counts[0]}")
            reduced_apart = self._reduced_apart(read)
            if reduced_apart is not None:
                return reduced_apart
            return Location(self.step, "gradient", module_of(name), what, first.diff.margin,
                            f"{matched}; it was changed after backward")
        return self._scaled_alike(read, scaled)

    def _last_pass_alone(self, name: str) -> bool:
        """Whether the optimizer read, of ``name``, what the last backward pass alone delivered to it (made whole as
        what every pass delivered is), where the passes before it delivered something."""
        last, every = self._delivered(name, "last_pass"), self._delivered(name)
        read, earlier = self._diff(self.ranks[0].read.get(name), last), self._diff(last, every)
        return read is not None and read.margin <= 1 and earlier is not None and earlier.margin > 1

    def _reduced_apart(self, read: list) -> Location | None:
        """Ranks whose backward delivered the reference's gradients, whose optimizer read some of them (not all) as
        the reference's times one whole count ``k`` or ``1/k``, for ``k`` at most the count of ranks, and the others
        as the reference's: those parameters' own collective (an experts' group, a hook on the norms) averaged over
        another count of ranks. A change after backward (a clip, a scale) acts on every gradient or by no count."""
        if len(self.ranks) < 2 or not read or any(m.name not in self.reference.read for m in read):
            return None
        apart = {m.name for m in read}
        if not any(name not in apart for name in self.reference.read):
            return None  # every gradient parts: nothing tells a collective from a change to them all
        factors: list[float] = []
        for mismatch in read:
            expected = self.reference.read[mismatch.name]
            actual = next((trace.read[mismatch.name] for trace in self.ranks if mismatch.name in trace.delivered
                           and mismatch.name in trace.read), None)  # as a rank that trains it read it
            delivered = self._diff(self._delivered(mismatch.name), self._reference_delivered(mismatch.name))
            factor = None if actual is None or actual.shape != expected.shape else factor_of(expected, actual)
            if delivered is None or delivered.margin > 1 or factor is None:
                return None
            factors.append(factor)
        factors.sort()
        count = round(max(factors[0], 1 / factors[0]), 3)
        if not _close(factors[0], factors[-1], 1e-4) or count != int(count) or not 2 <= count <= len(self.ranks):
            return None
        first, module = read[0], _common_module(sorted(apart))
        held = f"`{module}`'s" if module else "those"
        return Location(self.step, "communication", module, f"grad of {first.name!r} as the optimizer read it",
                        first.diff.margin, f"backward delivered the reference's gradient to every parameter; the "
                        f"optimizer read {held} parameters' as the reference's times {factors[0]:.6g} and every other "
                        f"as the reference's: their own collective averaged over another count of ranks")

    def _changed_after_reduction(self, name: str) -> str:
        """Why the gradient of a sharded parameter (FSDP2's) was changed after its collectives: what they left in it
        over the step, its parts joined, is the reference's backward's times one factor (the reduction was right, up
        to its average), and some rank's optimizer read another; "" where the records do not show it."""
        reduced, expected = self._joined_read(name, "reduced"), self._reference_delivered(name)
        if reduced is None or expected is None or reduced.shape != expected.shape or \
                factor_of(expected, reduced) is None:
            return ""
        for trace in self.ranks:
            left, read = trace.reduced.get(name), trace.read.get(name)
            if left is not None and read is not None and left.shape == read.shape and \
                    TensorDiff.of(read, left, self.tol).margin > 1:
                return (f"its reductions left the reference's gradient (times {factor_of(expected, reduced):.6g}); "
                        f"rank {trace.rank} read another than its reductions left: it was changed after them")
        return ""

    def _scaled_alike(self, read: list, scaled: dict[str, float]) -> Location | None:
        """Parts joined (FSDP2's shards), no record of backward parting, and every gradient the optimizer read apart
        is the reference's times one factor: scaled after backward (a clip by a wrong norm, a divide applied twice),
        where a reduction gone wrong would part each by its own. Else unsaid: nothing delivered says more."""
        if not read or set(scaled) != {m.name for m in read}:
            return None
        factors = sorted(scaled.values())
        if not _close(factors[0], factors[-1]) or _close(factors[0], 1.0):
            return None
        first = read[0]
        return Location(self.step, "gradient", module_of(first.name), f"grad of {first.name!r} as the optimizer read "
                        "it (its ranks' shards joined)", first.diff.margin,
                        f"no module's records part; every gradient read apart is the reference's times "
                        f"{factors[0]:.6g}: scaled after backward")

    def _ranks_read_apart(self, name: str) -> str:
        """Which rank read another gradient of ``name`` than the first rank, among the ranks that hold it whole (the
        reference's shape) and train it (backward reached it there): replicas, which a faithful step leaves alike. A
        shard is no replica, nor a copy a rank holds and never trains (another rank's expert): none is compared."""
        whole = self.reference.read.get(name)
        held = [(trace.rank, trace.read.get(name)) for trace in self.ranks if name in trace.delivered]
        held = [(rank, grad) for rank, grad in held if grad is not None and whole is not None and grad.shape == whole.shape]
        for rank, grad in held[1:]:
            if TensorDiff.of(grad, held[0][1], self.tol).margin > 1:
                return f"rank {rank} read another gradient than rank {held[0][0]}"
        return ""

    def _scaled_copies(self, name: str) -> bool:
        """Whether every rank read the reference's gradient of ``name`` times a factor of its own (clipped by its own
        norm, scaled on its own): changed after a reduction that was right."""
        expected = self.reference.read.get(name)
        if expected is None:
            return False
        return all(factor_of(expected, trace.read[name]) is not None for trace in self.ranks
                   if trace.read.get(name) is not None and trace.read[name].shape == expected.shape)

    def _read_as_delivered(self, name: str) -> bool:
        """Whether every rank read of ``name`` just what its own backward delivered to it (its loss scale divided out):
        a gradient no collective touched."""
        for trace in self.ranks:
            read, delivered = trace.read.get(name), trace.delivered.get(name)
            if read is None or delivered is None or read.shape != delivered.shape or \
                    TensorDiff.of(read, delivered / trace.loss_scale, self.tol).margin > 1:
                return False
        return True

    # -- records made whole
    def _joined_call(self, call: ModuleCall) -> ModuleCall | None:
        """The candidate's calls that stand for the reference's ``call``: the same call of each micro-batch and of
        each rank with a shard of its own, their records joined (None: they cannot be). A record no rank holds whole
        is joined from the parts ranks fed one batch hold, in rank order (a vocabulary or sequence split over a
        tensor-parallel group), where those parts join to the reference's shape along one dimension. Of a module
        whose parameters those ranks hold parts of, only the records they all hold alike are whole (an output its
        own collective reduced, the input they were all fed); the others are unknown (None)."""
        sharded = call.module in self.sharded
        pieces: list[list[ModuleCall]] = []  # each micro-batch's and data shard's call, as each replica made it
        for trace in self._holders(call.module):
            replicas = [self._standing_for(replica, call) for replica in self._replicas(trace)]
            if replicas[0] is None:
                return None
            replicas = [calls for calls in replicas if calls is not None and len(calls) == len(replicas[0])]
            pieces += [list(made) for made in zip(*replicas)]
        if sharded and any(len(piece) < 2 for piece in pieces):
            return None  # parts no two ranks fed one batch hold: none can be told whole
        joined = ModuleCall(call.module, call.index, [], [], random_state=pieces[0][0].random_state,
                            computed_in=pieces[0][0].computed_in)
        for field in ("inputs", "outputs", "integers", "grad_outputs", "grad_inputs"):
            expected = getattr(call, field)
            if any(len(getattr(made, field)) != len(expected) for piece in pieces for made in piece):
                return None
            records = [[[self._laid_out(getattr(made, field)[i], like) for made in piece] for piece in pieces]
                       for i, like in enumerate(expected)]
            setattr(joined, field, [self._sharded_record(groups, like) if sharded else _joined_records(groups, like)
                                    for groups, like in zip(records, expected)])
        return joined

    def _layout(self) -> tuple[int, ...] | None:
        """The order the candidate lays out its activations' dimensions in, where it is not the reference's: the
        permutation that turns the input of the first module both ran into the reference's exactly (a [sequence,
        batch] layout where the reference runs [batch, sequence]); None where they agree or none does."""
        theirs = {call.module: call for call in reversed(self.distinct[0].calls)}  # each module's first call
        first = next((call for call in self.reference.calls if call.module in theirs), None)
        if first is None:
            return None
        for actual, expected in zip(theirs[first.module].inputs, first.inputs):
            if actual is None or expected is None or actual.shape == expected.shape or actual.dim() != expected.dim():
                continue
            for order in itertools.permutations(range(actual.dim())):
                if tuple(actual.shape[d] for d in order) == expected.shape and torch.equal(actual.permute(order),
                                                                                         expected):
                    return order
        return None

    def _laid_out(self, record: Tensor | None, like: Tensor | None) -> Tensor | None:
        """A candidate's record in the reference's layout, where the run lays its activations out otherwise (and that
        layout brings the record's shape nearer the reference's: a record made in the reference's layout stays)."""
        if self.layout is None or record is None or like is None or record.dim() != len(self.layout):
            return record
        permuted = record.permute(self.layout)
        apart = [sum(size != other for size, other in zip(shape, like.shape)) for shape in (record.shape, permuted.shape)]
        return permuted if apart[1] < apart[0] else record

    def _sharded_record(self, groups: list[list[Tensor | None]], like: Tensor | None) -> Tensor | None:
        """One record of a module whose parameters ranks fed one batch hold parts of, whole: where every rank holds it
        alike (an output its own collective reduced, the input they were all fed), that; else where each rank of the
        one group fed the whole batch holds a slice of it (a column-parallel output, a row-parallel input), the
        slices joined in rank order; None where a rank holds the whole's shape otherwise (a partial sum, still to be
        reduced), or where several groups each hold slices of their own rows (the two joins' dimensions could be
        swapped and still make the whole's shape)."""
        if all(self._alike_parts(parts) for parts in groups):
            return _joined([parts[0] for parts in groups], like)
        if like is None or len(groups) != 1 or any(part is None or part.shape == like.shape for part in groups[0]):
            return None  # of several micro-batches' or data shards' slices, which dimension is whose is not told
        return _joined_records(groups, like, slices_only=True)

    def _alike_parts(self, parts: list[Tensor | None]) -> bool:
        """Whether every rank's record is the first rank's (within tolerance; token ids exactly)."""
        first = parts[0]
        if first is None or any(part is None or part.shape != first.shape for part in parts):
            return False
        if not (first.is_floating_point() or first.is_complex()):
            return all(torch.equal(part, first) for part in parts[1:])
        return all(TensorDiff.of(part, first, self.tol).margin <= 1 for part in parts[1:])

    def _standing_for(self, trace: StepTrace, call: ModuleCall) -> list[ModuleCall] | None:
        """``trace``'s calls that stand for the reference's ``call`` (one a micro-batch), in order; None where its
        count of calls of that module is no multiple of the reference's."""
        per_call = len(self.calls[call.module])
        calls = sorted((c for c in trace.calls if c.module == call.module), key=lambda c: c.index)
        if not calls or len(calls) % per_call:
            return None
        return calls[call.index::per_call]

    def _replicas(self, trace: StepTrace) -> list[StepTrace]:
        """The ranks fed what ``trace``'s rank was (a tensor-parallel group), in rank order, that rank first."""
        return [trace] + sorted((t for t in self.ranks if t is not trace and _same(t.root_inputs, trace.root_inputs)),
                                key=lambda t: t.rank)

    def _holders(self, module: str) -> list[StepTrace]:
        """The ranks whose records of ``module`` join into the reference's: those of the one pipeline stage that ran
        it (every rank with data of its own where no pipeline cuts the model)."""
        held = [stage for stage, modules in zip(self.stages, self.staged) if module in modules]
        return held[0] if len(held) == 1 else self.distinct

    def _delivered(self, name: str, record: str = "delivered") -> Tensor | None:
        """What backward delivered to ``name`` on the ranks with shards of their own that train it, summed, as the
        reference's (a rank it never reached added nothing); None where their parts are no whole tensors. ``record``
        ``"last_pass"``: what the last backward pass that reached it delivered."""
        traces = self.distinct
        if self._split_over_replicas(module_of(name)):  # each rank fed one batch delivered a part of the sum
            traces = [replica for trace in self.distinct for replica in self._replicas(trace)]
        parts = [getattr(trace, record)[name] for trace in traces if name in getattr(trace, record)]
        if not parts or len({part.shape for part in parts}) != 1:
            return None
        whole = self.reference.delivered.get(name)
        if whole is not None and parts[0].shape != whole.shape:
            return self._delivered_in_parts(name) if record == "delivered" else None
        return self._averaged(sum(parts[1:], parts[0]))

    def _delivered_in_parts(self, name: str) -> Tensor | None:
        """What backward delivered to a parameter each rank holds a part of, whole: the parts put at their places,
        where each rank's optimizer read just what its backward delivered (and no loss scale or average stands
        between the two); None where not."""
        if self.scale != 1:
            return None
        for trace in self.ranks:
            delivered, read = trace.delivered.get(name), trace.read.get(name)
            if (delivered is None) != (read is None) or (delivered is not None and (
                    delivered.shape != read.shape or TensorDiff.of(read, delivered, self.tol).margin > 1)):
                return None
        return self._joined_read(name)

    def _split_over_replicas(self, module: str) -> bool:
        """Whether ranks fed one batch ran ``module`` on different parts of its input (its heads or its sequence
        split over a tensor-parallel group), so that each delivered its parameters a part of their gradient."""
        calls = self.calls.get(module)
        if not calls:
            return False
        replicas = [self._standing_for(trace, calls[0]) for trace in self._replicas(self._holders(module)[0])]
        return len(replicas) > 1 and all(replicas) and not self._alike(replicas[1][0].inputs, replicas[0][0].inputs)

    def _averaged(self, tensor: Tensor | None) -> Tensor | None:
        """A rank's activation gradient as the reference's: a rank whose gradients are averaged over ``averaged``
        ranks back-propagates that many times its share, times its loss scale."""
        return tensor if tensor is None or self.scale == 1 else tensor / self.scale

    def _unscaled(self, tensor: Tensor | None) -> Tensor | None:
        """The reference's activation gradient (or what backward delivered) without its loss scale."""
        return tensor if tensor is None or self.reference_scale == 1 else tensor / self.reference_scale

    def _reference_delivered(self, name: str) -> Tensor | None:
        return self._unscaled(self.reference.delivered.get(name))

    def _diff(self, actual: Tensor | None, expected: Tensor | None) -> TensorDiff | None:
        """How ``actual`` differs from ``expected``; None where it cannot be told (one is missing, shapes differ)."""
        if actual is None or expected is None or actual.shape != expected.shape:
            return None
        return TensorDiff.of(actual, expected, self.tol)


@dataclasses.dataclass
class _Replicated:
    """One call as the ranks fed one batch made it: for each record field, the first rank whose record is not the
    first rank's (``""`` where all are alike), the first rank's record and the ranks' records added, each joined over
    micro-batches and data shards."""

    apart: dict[str, str]
    first: dict[str, list[Tensor | None]]
    summed: dict[str, list[Tensor | None]]
    rank: int = 0  # the first rank


def _distinct_data(ranks: Sequence[StepTrace]) -> list[StepTrace]:
    """The ranks fed data of their own, in rank order: a rank fed what an earlier one was (a tensor-parallel group's
    ranks see one batch) holds no other rows."""
    kept: list[StepTrace] = []
    for trace in sorted(ranks, key=lambda t: t.rank):
        if not any(_same(trace.root_inputs, other.root_inputs) for other in kept):
            kept.append(trace)
    return kept


def _stages(ranks: Sequence[StepTrace]) -> list[list[StepTrace]]:
    """``ranks`` grouped by the pipeline stage each ran, in rank order: a stage is known by its outermost modules
    called (the whole model, where no pipeline cuts it, on every rank; a tensor- or expert-parallel rank's own
    modules lie inside those)."""
    stages: dict[frozenset[str], list[StepTrace]] = {}
    for trace in ranks:
        called = {call.module for call in trace.calls}
        outermost = frozenset(name for name in called if not any(_within(name, other) for other in called))
        stages.setdefault(outermost, []).append(trace)
    return list(stages.values())


def _ancestors(name: str) -> list[str]:
    """The modules that hold module ``name``, nearest first, the root last."""
    parts = name.split(".") if name else []
    return [".".join(parts[:end]) for end in range(len(parts) - 1, -1, -1)]


def _common_module(names: list[str]) -> str:
    """The innermost module that holds every parameter in ``names``."""
    return _common_ancestor([module_of(name) for name in names])


def _common_ancestor(modules: list[str]) -> str:
    """The innermost module that holds (or is) every module in ``modules`` ("" for the root)."""
    paths = [module.split(".") for module in modules]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(part for part in common if part)


def _drew_otherwise(theirs: ModuleCall, call: ModuleCall) -> bool:
    """Whether both calls drew from the random generator, from other states."""
    ours, other = call.random_state, theirs.random_state
    return ours is not None and other is not None and (ours.shape != other.shape or not torch.equal(ours, other))


def _within(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` (every module inside the root, ``""``)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _same(first: list[Tensor], second: list[Tensor]) -> bool:
    return len(first) == len(second) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(first, second))


def _joined(pieces: list[Tensor | None], like: Tensor | None) -> Tensor | None:
    """``pieces`` (micro-batches' or ranks' rows, in order) as one tensor shaped ``like``: joined along the one
    dimension where their sizes add up to its size; None where no dimension does."""
    if like is None or any(piece is None for piece in pieces):
        return None
    if len(pieces) == 1:
        return pieces[0] if pieces[0].shape == like.shape else None
    for dim in range(like.dim()):
        if all(p.dim() == like.dim() and all(p.shape[d] == like.shape[d] for d in range(like.dim()) if d != dim)
               for p in pieces) and sum(p.shape[dim] for p in pieces) == like.shape[dim]:
            return torch.cat(pieces, dim)
    return None


def _joined_records(groups: list[list[Tensor | None]], like: Tensor | None,
                    slices_only: bool = False) -> Tensor | None:
    """One record of a call, whole: each group (one micro-batch's or data shard's record, as each rank fed it
    made it) stands for its first rank's record, joined as :func:`_joined` joins pieces; where those cannot make up
    ``like`` (or ``slices_only``: the ranks hold slices), each group's parts (a tensor-parallel group's, in rank
    order) joined along one dimension first. None where neither gives ``like``'s shape."""
    whole = None if slices_only else _joined([parts[0] for parts in groups], like)
    if whole is not None or like is None or \
            any(len(parts) < 2 or any(part is None for part in parts) for parts in groups):
        return whole
    for dim in range(like.dim()):
        if all(len({(p.dim(),) + tuple(p.shape[d] for d in range(p.dim()) if d != dim) for p in parts}) == 1
               and parts[0].dim() == like.dim() for parts in groups):
            joined = _joined([torch.cat(parts, dim) for parts in groups], like)
            if joined is not None:
                return joined
    return None


def _owned(delivered: dict[str, Tensor]) -> dict[str, list[str]]:
    """Each module's own parameters (not its children's), by the names backward delivered to."""
    owned: dict[str, list[str]] = {}
    for name in delivered:
        owned.setdefault(module_of(name), []).append(name)
    return owned


def _nth(what: str, position: int, of: Sequence) -> str:
    """``the input`` of a call with one, ``input 1`` of one with several."""
    return f"the {what}" if len(of) == 1 else f"{what} {position}"


def _named(call: ModuleCall) -> str:
    return f"`{call.module}`" if call.module else "the model"


def _close(actual: float, expected: float, relative: float = 1e-9) -> bool:
    return abs(actual - expected) <= 1e-12 + relative * abs(expected)
