"""The replays a location is read from: both runs again with the step that parts traced, each held to the run it
replays; a compiled run with its parameters hooked alone, as its eager twin, and with one module compiled at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from ...diff import Comparison, Location, TensorDiff
from ...precision import Tolerance
from ...result import RunResult
from ...trace import StepTrace
from . import documents
from .told import UNSEEN
from .records import ancestors, module_of
from .walk import Walk


# both runs again with steps traced: (steps, whether the modules' calls are recorded too, whether torch.compile's code
# runs uncompiled: True, the eager twin; or the modules named, each uncompiled inside the compiled code) ->
# (reference, candidate)
Replay = Callable[[tuple[int, ...], bool, bool | tuple[str, ...]], tuple[RunResult, RunResult]]


# the most replays spent narrowing the compiler's location to one module (each with one module alone compiled)
NARROWING_REPLAYS = 24


class ReplayDiffers(Exception):
    """A replay did not train as the run it replays did (code whose behaviour the hooks change, a step that keeps
    state across runs): its records say nothing about that run, so no location is said."""


class Replayed:
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
        forwards = sum(call.module == "" for call in theirs[0].calls) or None
        reference, ranks, read = documents.per_document(ours[0], theirs)
        walk = Walk(reference, ranks, self.comparison, step)
        found = walk.carried_into() if state_only else walk.first()
        if found is None:
            return None
        fed = documents.fed_apart(reference, ranks) if read == documents.READ_PER_DOCUMENT and (
            found.phase, found.module) == ("forward", "") else ""
        return dataclasses.replace(found, forwards=forwards,
                                   matched="; ".join(filter(None, (fed or found.matched, how, read))))

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
        compiled = self._compiled(step, bool(held))
        if held is not None and not compiled:
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
        if len(theirs) == 1 and compiled and self._reads_the_references(theirs[0], step):
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
        recorded = _recorded_at(self.recorded[0], step)
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
            path = [module, *ancestors(module)] if module else [""]
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


def _recorded_at(run: RunResult, step: int) -> dict:
    """The gradients ``run`` recorded at ``step``: none where it took fewer steps."""
    return run.grads[step] if step < len(run.grads) else {}


def _not_as_recorded(run: RunResult, trace: StepTrace, step: int, tol: Tolerance) -> str:
    """The first parameter whose gradient ``trace`` read at ``step`` is not the one ``run`` recorded there (where it
    recorded one, whole as the trace holds it), quoted; "" where they agree."""
    for name, grad in _recorded_at(run, step).items():
        read = trace.read.get(name)
        if read is not None and read.shape == grad.shape and TensorDiff.of(read, grad, tol).margin > 1:
            return repr(name)
    return ""
