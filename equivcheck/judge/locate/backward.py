"""The backward of a traced step: the first module, in the order backward reaches its inputs, whose output gradient
matches and whose input gradient, or what backward delivered to its own parameters, does not; the gradients ranks
never summed, or changed on their way between modules.
"""

from __future__ import annotations

import torch

from ...diff import Location
from ...trace import ModuleCall
from .told import Told, UNSEEN
from .records import described_call, joined_parts, module_of, modules_owning, nth, Records, Replicated, within


class Backward(Records):
    """The backward's records, module by module."""

    def _backward(self) -> Location | None:
        owned = modules_owning(self.reference.delivered)
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
                found = self._read_outside(module, owned.get(module, ()))
                if found is not None:
                    return found
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
                                    f"{nth('input', position, call.inputs)} of {described_call(call)}", diff.margin, matched,
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

    def _read_outside(self, module: str, parameters: tuple[str, ...] | list[str]) -> Location | None:
        """A module the run never called, whose parameters backward still delivered to: code outside its forward read
        them (a fused loss handed the lm_head's weight, a functional call). Where what it delivered differs, backward
        parts there, in the code that stood in for the module's forward. None where the run called it (its records
        could not be made whole: nothing is said) or every such gradient matches."""
        if any(call.module == module for trace in self.ranks for call in trace.calls):
            return None
        for name in parameters:
            diff = self._diff(self._delivered(name), self._reference_delivered(name))
            if diff is not None and diff.margin > 1:
                return Location(self.step, "backward", module, f"the gradient backward delivered to {name!r}",
                                diff.margin, f"the run never called `{module}`: code outside its forward read its "
                                "parameters (a fused loss, a functional call) and made this gradient", own_code=True)
        return None

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
        what, it = ("the output", "its output") if sent == "grad_outputs" else (nth("input", 0, call.inputs), "it")
        told = "was sent another gradient for it" if sent == "grad_outputs" else \
            "sent back another gradient for its input"
        return Location(self.step, "communication", call.module, f"the gradient of {what} of {described_call(call)}", margin,
                        f"ranks fed one batch computed {it} alike; {made.apart[sent]} {told} than rank {made.rank}, "
                        "and theirs add up to the reference's: partial sums no collective added up")

    def _over_replicas(self, call: ModuleCall) -> Replicated | None:
        """``call`` as each rank fed one batch made it, its records joined over micro-batches and data shards; None
        where some rank's calls cannot stand for it, or no two ranks were fed one batch."""
        fields = ("inputs", "outputs", "grad_outputs", "grad_inputs")
        made = Replicated(apart=dict.fromkeys(fields, ""), first={}, summed={})
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
            made.first[field] = [joined_parts([self._laid_out(record[i], like) for record in firsts[field]], like)
                                 for i, like in enumerate(getattr(call, field))]
            made.summed[field] = [joined_parts([self._laid_out(record[i], like) for record in summed[field]], like)
                                  for i, like in enumerate(getattr(call, field))]
        return made

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
                                    f"{nth('input', at, call.inputs)} of {described_call(call)}", own.margin,
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
                                    f"{nth('output', position, call.outputs)} of {described_call(call)}", diff.margin,
                                    f"{consumers} passed back the reference's gradient to it: it changed on its way")
        return None

    def _passed_back_alike(self, call: ModuleCall, position: int) -> str:
        """The modules (quoted) that output ``position`` of ``call`` feeds, where in both runs the gradients they
        passed back to it add up to the reference's gradient of that output (so they account for all of it); "" where
        none does, or they do not."""
        output, expected = call.outputs[position], self._unscaled(call.grad_outputs[position])
        fed = [(other, at) for other in self.reference.calls for at, given in enumerate(other.inputs)
               if given is not None and given.shape == output.shape and torch.equal(given, output)]
        fed = [(other, at) for other, at in fed if not any(within(other.module, outer.module) for outer, _ in fed)]
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
