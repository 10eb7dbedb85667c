"""The forward of a traced step: the first module, in the order forwards finish, whose inputs match and whose
output does not; the batch the model was fed; the precision the run's modules computed in; the random state a module
drew from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...diff import COMPUTED_IN, Location
from ...trace import ModuleCall, StepTrace
from .told import shown, Told, UNSEEN
from .records import ancestors, common_ancestor, described_call, drew_otherwise, nth, Records


# the argument that judges a run under the precision its modules computed in
JUDGED_IN = {"bfloat16": 'dtype="bf16-master" (bfloat16 parameters over float32 master weights, as a MixedPrecisionPolicy '
                         'casts them), dtype="bf16-autocast" (autocast) or dtype=torch.bfloat16 (pure bf16)',
             "float16": 'dtype="fp16-autocast"', "float32": "dtype=torch.float32"}


class Forward(Records):
    """The forward's records, module by module."""

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
        named = shown([module for module in apart if module]) or "the model"  # the root's follows its children's
        return Location(self.step, "forward", common_ancestor(apart), COMPUTED_IN,
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
                    if drew_otherwise(theirs, call):
                        return Location(self.step, "state", "", f"the random state {described_call(call)} drew from", None,
                                        f"its inputs match; the random generator's state it began from is not the "
                                        f"reference's: the random stream carried into step {self.step} differs")
                    children, own_code = self._children_told(call.module, "their inputs", told)
                    return Location(self.step, "forward", call.module, f"{nth('output', position, call.outputs)} of "
                                    f"{described_call(call)}", diff.margin, "its inputs match" + children, own_code)
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
            caller = next((name for name in ancestors(call.module) if name in self.calls), parent)
            code = f"`{caller}`'s own code" if caller else "the code that calls it (the model's or the team's step)"
            return Location(self.step, "forward", caller, f"{nth('input', position, call.inputs)} of "
                            f"{described_call(call)}", diff.margin, f"every module that ran before it computes alike from "
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
