"""Both runs' records of one traced step, made whole before they are compared.

A record that cannot be made whole (a tensor-parallel shard, a module called another number of times) is left out,
never guessed at: the next record decides. Each comparison is judged at the check's own tolerance.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from ...diff import Comparison, TensorDiff
from ...precision import Tolerance
from ...trace import ModuleCall, StepTrace
from .told import shown, Told


class Records:
    """Both runs' records of one traced step, made whole to be compared: micro-batches' and ranks' rows joined
    along the dimension where they add up to the reference's, repeated ranks (a tensor-parallel group fed one batch)
    counted once, the activation gradients of ranks whose gradients are averaged divided by their count. The readings
    (:mod:`.carried`, :mod:`.forward`, :mod:`.loss`, :mod:`.backward`, :mod:`.after_backward`) read them."""

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

    def _alike(self, first: list[Tensor | None], second: list[Tensor | None]) -> bool:
        """Whether two ranks' records of one call agree (an input that is no tensor, alike)."""
        return all((a is None and b is None) or self._alike_parts([b, a]) for a, b in zip(first, second))

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
        said = f"; its children ({shown(alike)}) compute alike from {given}" if alike else "; its children"
        if otherwise:
            said += f"{',' if alike else ''} ({shown(otherwise)}) are handed otherwise, by the code around them"
        if not unseen:
            return said + ": its own code", bool(alike or otherwise)
        reasons = "; ".join(f"{shown(names)} {why}" for why, names in told.why(unseen).items())
        opening = said + "; " if alike or otherwise else "; "
        return (f"{opening}{reasons}: its own code is not claimed (the difference is in "
                f"{f'`{module}`' if module else 'the model'} or in them)"), False

    def _sharded_for_storage(self, name: str) -> bool:
        """Whether every rank's part of ``name`` has its place in the whole recorded, and no two ranks fed one batch
        hold different parts (which only tensor parallelism does)."""
        if not all(name in trace.placed for trace in self.ranks if name in trace.read):
            return False
        parts = [(trace.root_inputs, trace.placed[name][1]) for trace in self.ranks if name in trace.placed]
        return all(offset == other_offset or not same_tensors(batch, other_batch)
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
            return joined_parts([parts[0] for parts in groups], like)
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
        return [trace] + sorted((t for t in self.ranks if t is not trace and same_tensors(t.root_inputs, trace.root_inputs)),
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


def module_of(name: str) -> str:
    """The module that holds parameter (or buffer) ``name``: ``'blocks.1.fc2'`` of ``'blocks.1.fc2.weight'``."""
    return name.rpartition(".")[0]


@dataclasses.dataclass
class Replicated:
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
        if not any(same_tensors(trace.root_inputs, other.root_inputs) for other in kept):
            kept.append(trace)
    return kept


def _stages(ranks: Sequence[StepTrace]) -> list[list[StepTrace]]:
    """``ranks`` grouped by the pipeline stage each ran, in rank order: a stage is known by its outermost modules
    called (the whole model, where no pipeline cuts it, on every rank; a tensor- or expert-parallel rank's own
    modules lie inside those)."""
    stages: dict[frozenset[str], list[StepTrace]] = {}
    for trace in ranks:
        called = {call.module for call in trace.calls}
        outermost = frozenset(name for name in called if not any(within(name, other) for other in called))
        stages.setdefault(outermost, []).append(trace)
    return list(stages.values())


def ancestors(name: str) -> list[str]:
    """The modules that hold module ``name``, nearest first, the root last."""
    parts = name.split(".") if name else []
    return [".".join(parts[:end]) for end in range(len(parts) - 1, -1, -1)]


def common_module(names: list[str]) -> str:
    """The innermost module that holds every parameter in ``names``."""
    return common_ancestor([module_of(name) for name in names])


def common_ancestor(modules: list[str]) -> str:
    """The innermost module that holds (or is) every module in ``modules`` ("" for the root)."""
    paths = [module.split(".") for module in modules]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(part for part in common if part)


def drew_otherwise(theirs: ModuleCall, call: ModuleCall) -> bool:
    """Whether both calls drew from the random generator, from other states."""
    ours, other = call.random_state, theirs.random_state
    return ours is not None and other is not None and (ours.shape != other.shape or not torch.equal(ours, other))


def within(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` (every module inside the root, ``""``)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def same_tensors(first: list[Tensor], second: list[Tensor]) -> bool:
    return len(first) == len(second) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(first, second))


def joined_parts(pieces: list[Tensor | None], like: Tensor | None) -> Tensor | None:
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
    made it) stands for its first rank's record, joined as :func:`joined_parts` joins pieces; where those cannot make up
    ``like`` (or ``slices_only``: the ranks hold slices), each group's parts (a tensor-parallel group's, in rank
    order) joined along one dimension first. None where neither gives ``like``'s shape."""
    whole = None if slices_only else joined_parts([parts[0] for parts in groups], like)
    if whole is not None or like is None or \
            any(len(parts) < 2 or any(part is None for part in parts) for parts in groups):
        return whole
    for dim in range(like.dim()):
        if all(len({(p.dim(),) + tuple(p.shape[d] for d in range(p.dim()) if d != dim) for p in parts}) == 1
               and parts[0].dim() == like.dim() for parts in groups):
            joined = joined_parts([torch.cat(parts, dim) for parts in groups], like)
            if joined is not None:
                return joined
    return None


def modules_owning(delivered: dict[str, Tensor]) -> dict[str, list[str]]:
    """Each module's own parameters (not its children's), by the names backward delivered to."""
    owned: dict[str, list[str]] = {}
    for name in delivered:
        owned.setdefault(module_of(name), []).append(name)
    return owned


def nth(what: str, position: int, of: Sequence) -> str:
    """``the input`` of a call with one, ``input 1`` of one with several."""
    return f"the {what}" if len(of) == 1 else f"{what} {position}"


def described_call(call: ModuleCall) -> str:
    return f"`{call.module}`" if call.module else "the model"


def nearly_equal(actual: float, expected: float, relative: float = 1e-9) -> bool:
    return abs(actual - expected) <= 1e-12 + relative * abs(expected)
