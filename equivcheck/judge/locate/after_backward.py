"""Between backward and the update: backward delivered the reference's gradients and the optimizer read others.
``communication`` where ranks that should hold the same gradient read different ones (never reduced) or a group's own
collective is off by a count of ranks; ``gradient`` where something changed them after backward (clipping, a hook,
scaling, zeroing, the last backward pass's alone).
"""

from __future__ import annotations

from ...diff import Location, ProblemKind, TensorDiff, kind_of
from ..hints import factor_of
from .records import common_module, module_of, nearly_equal, Records


class AfterBackward(Records):
    """What the optimizer read, against what backward delivered."""

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
        if not nearly_equal(factors[0], factors[-1], 1e-4) or count != int(count) or not 2 <= count <= len(self.ranks):
            return None
        first, module = read[0], common_module(sorted(apart))
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
        if not nearly_equal(factors[0], factors[-1]) or nearly_equal(factors[0], 1.0):
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
