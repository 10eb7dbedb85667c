"""What a traced step started from: the weights, buffers, the optimizer's settings and state it began with.

``state`` / ``optimizer``: the weights at the start of the step already differ (the previous step's update, or the
optimizer's settings carried to it, parted); or the weights match and a buffer, the optimizer's settings (a schedule)
or its state (a resume that lost them) do not.
"""

from __future__ import annotations

from ...diff import Location
from .records import module_of, nearly_equal, Records


class Carried(Records):
    """The step's starting point, against the reference's."""

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
            in_shards = name in self.held_in_parts
            return Location(self.step - 1, "optimizer", module_of(name), f"weight {name!r} after the step",
                            diff.margin, f"every gradient the optimizer read at step {self.step - 1} matches" + (
                                f"; each rank held a shard of {name!r} and its optimizer stepped that shard"
                                if in_shards else ""), in_shards=in_shards)
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
                if key in actual and not nearly_equal(actual[key], value):
                    return f"the optimizer's {key} of parameter group {group} ({actual[key]:.6g}, the reference's {value:.6g})"
        return ""

    def _held_state(self) -> dict:
        """The optimizer's state as the ranks held it, each tensor from the first rank that holds it: a sharded
        optimizer (ZeRO's partitions, a distributor's) keeps a parameter's state on its owner alone, and state no rank
        holds is the only state the run lacks."""
        held: dict = {}
        for trace in self.ranks:
            for key, value in trace.optimizer_state.items():
                held.setdefault(key, value)
        return held

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
        theirs = self._held_state()
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
