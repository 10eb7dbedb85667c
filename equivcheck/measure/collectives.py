"""Counting what the parallel wrappers communicate: no_sync() and set_requires_gradient_sync(False) exist to
skip collectives, so prove that they do; and say what ZeRO, join and pipeline schedules send besides."""

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..errors import InvalidArgument
from ..process.torch_imports import fsdp2, is_fsdp_module


# A comm hook as DDP takes it, (state, bucket) -> a future of the reduced bucket, and what makes one per wrapper.
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]
HookFactory = Callable[[dist.ProcessGroup], tuple[Any, CommHook]]


@dataclasses.dataclass
class CommCounter:
    """A DDP communication hook's state: counts every gradient bucket, then all-reduces it as usual.

    A *sync* is one synchronised backward pass of one wrapper: DDP hands its buckets to the hook one by
    one and the last bucket closes the round, whatever the number of buckets. A model wrapped in parts
    (trunk and head each in DDP) makes one sync per wrapper per step. A hook that all-reduces a bucket's
    worth of gradients more than once while it runs (a team's hook all-reducing every bucket twice) makes
    that round count as many syncs: the most whole buckets' worth of elements it all-reduced for one bucket,
    and always at least one (a compressing hook sends a bucket's worth or less: PowerSGD's factors, a
    float16 copy of the same elements).
    """

    process_group: dist.ProcessGroup | None = None
    syncs: int = 0
    bytes: int = 0
    wrappers: int = 0
    # Nothing by kind: the hook's all-reduces (one per bucket, or a compressing hook's several) are counted where
    # they are made, with the bytes really sent, by the CallCounter beside it.
    last_step: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def attach(cls, module: nn.Module, hook: HookFactory | None = None) -> "CommCounter":
        """Count every DDP wrapper in ``module``: the module itself, or the wrappers it holds.

        DDP takes one comm hook per wrapper, and this counter is it: a regime that communicates through a
        hook of its own (fp16 compression, PowerSGD) hands ``hook``, which makes each wrapper's (state,
        hook) pair from its process group; every bucket is counted, then handed to that hook instead of
        the default all-reduce. A hook the team registered on a wrapper itself (``register_comm_hook`` in
        its wrap, before this, or in its step, after) is wrapped the same way: the team's hook runs, each
        call of it counted as the default's would be (see :func:`_take_over_teams_hook`)."""
        counter = cls()
        for wrapper in (m for m in module.modules() if isinstance(m, DistributedDataParallel)):
            counter.process_group = wrapper.process_group
            counter.wrappers += 1
            state, inner = hook(wrapper.process_group) if hook is not None else (wrapper.process_group,
                                                                                default_hooks.allreduce_hook)
            teams = _take_over_teams_hook(wrapper, regimes=hook is not None)
            counted = _Counted(counter, inner, state) if teams is None else _Counted(counter, teams[0], teams[1],
                                                                                     teams=True)
            wrapper.register_comm_hook(counted, _counting_hook)
            _adopt_later_hooks(wrapper, counted)
        return counter

    def take(self) -> tuple[int, int]:
        """The syncs and the bytes of their buckets since the last call (one optimizer step's worth)."""
        taken = (self.syncs, self.bytes)
        self.syncs = self.bytes = 0
        return taken


@dataclasses.dataclass
class _Counted:
    """One wrapper's hook state: the shared counter, and the hook (with its own state) that communicates."""

    counter: CommCounter
    hook: CommHook
    state: Any
    teams: bool = False  # the hook is one the team registered on the wrapper itself
    most: int = 1  # the most whole buckets' worth one bucket of the round in progress was all-reduced


# DDP inspects the hook's annotations at run time, so they must be real objects, not strings.
def _counting_hook(counted: _Counted, bucket: dist.GradBucket):
    buffer = bucket.buffer()
    outer = getattr(_in_hook, "elements", None)  # a hook run from inside another's: both see its all-reduces
    _in_hook.elements = 0
    try:
        future = counted.hook(counted.state, bucket)
        times = max(1, _in_hook.elements // buffer.numel()) if buffer.numel() else 1
    finally:
        _in_hook.elements = outer if outer is None else outer + _in_hook.elements
    counted.counter.bytes += buffer.numel() * buffer.element_size() * times
    counted.most = max(counted.most, times)
    if bucket.is_last():
        counted.counter.syncs += counted.most
        counted.most = 1
    return future


# The words torch refuses a second comm hook with, kept for a team's second registration.
ONE_HOOK = "register_comm_hook or register_builtin_comm_hook can only be called once."


def _take_over_teams_hook(wrapper: DistributedDataParallel, *, regimes: bool) -> tuple[CommHook, Any] | None:
    """The (hook, state) the team registered on ``wrapper`` before the counter came, or None where it registered none.

    DDP's reducer takes one comm hook for its lifetime, and torch has no call that replaces it; so where the team's
    is in place the reducer is built again, as torch's own unpickling of a DDP model builds it (same parameters,
    buckets and options), the old one's autograd hooks removed first, and the team's hook goes inside the counting
    one. A built-in hook (``_register_builtin_comm_hook``, C++) has nothing to call from Python: refused, naming
    the Python twin to register instead."""
    teams = list(getattr(wrapper, "_comm_hooks", ()))
    if not teams:
        logged = wrapper._get_ddp_logging_data().get("comm_hook", "") if hasattr(wrapper, "_get_ddp_logging_data") \
            else ""
        if logged.startswith("BuiltinCommHookType"):
            raise InvalidArgument(
                f"a DDP wrapper carries the built-in comm hook {logged} (registered with "
                "_register_builtin_comm_hook): it runs in C++, so equivcheck cannot count its all-reduces. Expected "
                "a Python hook registered with register_comm_hook: torch's default_hooks.allreduce_hook or "
                "default_hooks.fp16_compress_hook do what ALLREDUCE and FP16_COMPRESS do")
        return None
    if len(teams) > 1 or regimes:
        raise InvalidArgument(
            f"a DDP wrapper carries the comm hook(s) {', '.join(h.__qualname__ for h, _ in teams)} and "
            f"{'this regime brings its own' if regimes else 'torch takes one per wrapper'}: expected one hook per "
            "wrapper")
    hook, state = teams[0]
    _rebuild_reducer(wrapper)
    return hook, state


def _rebuild_reducer(wrapper: DistributedDataParallel) -> None:
    """``wrapper``'s reducer made again with no comm hook: what ``DistributedDataParallel.__setstate__`` does (a
    private path of torch's, the only one that builds a reducer), plus the mixed-precision dtype its constructor
    sets; the old reducer's autograd hooks are removed, so it never reduces again."""
    old = wrapper.reducer
    old._remove_autograd_hooks()
    parameters, expect_sparse_gradient = wrapper._build_params_for_reducer()
    wrapper._ddp_init_helper(parameters, expect_sparse_gradient,
                             wrapper._build_debug_param_to_name_mapping(parameters), wrapper.static_graph)
    if wrapper.static_graph:
        wrapper.reducer._set_static_graph()
        wrapper.logger._set_static_graph()
    if getattr(wrapper, "mixed_precision", None) is not None:
        wrapper.reducer._set_mixed_precision_param_dtype(wrapper.mixed_precision.param_dtype)
    wrapper._comm_hooks = []


def _adopt_later_hooks(wrapper: DistributedDataParallel, counted: _Counted) -> None:
    """A hook the team registers after the counter (in its step) goes inside the counting one, on this wrapper
    only, as torch would take it: checked as torch checks it, and a second one refused in torch's words."""

    def register_comm_hook(state: object, hook: Callable) -> None:
        if counted.teams:
            raise RuntimeError(ONE_HOOK)
        wrapper._check_comm_hook(hook)
        counted.hook, counted.state, counted.teams = hook, state, True

    register_comm_hook.__doc__ = DistributedDataParallel.register_comm_hook.__doc__
    wrapper.register_comm_hook = register_comm_hook


@dataclasses.dataclass
class ShardedCommCounter:
    """What FSDP2 communicates, by kind: its reduce-scatters (one per sharded block per synchronised
    backward: the *syncs*) and its all-gathers (parameters gathered for forward and backward), each
    with the bytes this rank hands to the collective. Installed as every FSDP module's own comm.

    A block whose shard group holds one rank (HSDP on a W x 1 mesh) reduce-scatters nothing: its gradients are
    synchronised by the replicas' all-reduce alone. Every block's finished reduction (FSDP2's all-reduce hook,
    which runs after the reduce-scatter or the replicas' all-reduce) is counted too where its mesh holds more than
    one rank (on one rank nothing is sent), and a step's syncs are the more of the two counts, so such a block's
    sync is not missed and no other count changes."""

    wrappers: int = 0
    calls: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"reduce_scatter": 0, "all_gather": 0, "reduced": 0})
    sent: dict[str, int] = dataclasses.field(default_factory=lambda: {"reduce_scatter": 0, "all_gather": 0, "reduced": 0})
    last_step: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # kind -> (calls, bytes)

    @classmethod
    def attach(cls, module: nn.Module) -> "ShardedCommCounter":
        counter = cls()
        counting_reduce_scatter, counting_all_gather = _counting_collectives()
        for sharded in (m for m in module.modules() if is_fsdp_module(m)):
            own = _parameters_of_its_own(sharded)
            if any(p.requires_grad for p in own):  # a root holding none, or a frozen block, syncs nothing
                counter.wrappers += 1
                sharded.set_custom_reduce_scatter(counting_reduce_scatter(counter))
                sharded.set_custom_all_gather(counting_all_gather(counter))
                mesh = getattr(own[0], "device_mesh", None)  # a DTensor's: on a mesh of one rank nothing is sent
                if mesh is not None and mesh.size() > 1 and hasattr(sharded, "set_all_reduce_hook"):  # torch >= 2.6
                    sharded.set_all_reduce_hook(functools.partial(counter.count, "reduced"))
        return counter

    def count(self, kind: str, tensor) -> None:
        self.calls[kind] += 1
        self.sent[kind] += tensor.numel() * tensor.element_size()

    def take(self) -> tuple[int, int]:
        """The gradient syncs and their bytes since the last call (one optimizer step's worth): the reduce-scatters,
        or the finished reductions where there were more of those; every kind stays readable in ``last_step`` as
        its (calls, bytes), the finished reductions left out."""
        taken = {kind: (self.calls[kind], self.sent[kind]) for kind in self.calls}
        for kind in self.calls:
            self.calls[kind] = self.sent[kind] = 0
        reduced = taken.pop("reduced")
        self.last_step = taken
        return reduced if reduced[0] > taken["reduce_scatter"][0] else taken["reduce_scatter"]


def _parameters_of_its_own(sharded: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``sharded`` that no FSDP module inside it shards (public API only: FSDP2's private state
    differs between torch releases)."""
    inner = {id(p) for m in sharded.modules() if m is not sharded and is_fsdp_module(m) for p in m.parameters()}
    return [p for p in sharded.parameters() if id(p) not in inner]


@functools.cache
def _counting_collectives() -> tuple[type, type]:
    """FSDP2's reduce-scatter and all-gather, each counting what it sends (made on first use: FSDP2 is
    imported only then)."""
    torch_fsdp = fsdp2()

    class CountingReduceScatter(torch_fsdp.DefaultReduceScatter):
        def __init__(self, counter: ShardedCommCounter) -> None:
            self.counter = counter

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.counter.count("reduce_scatter", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    class CountingAllGather(torch_fsdp.DefaultAllGather):
        def __init__(self, counter: ShardedCommCounter) -> None:
            self.counter = counter

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.counter.count("all_gather", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return CountingReduceScatter, CountingAllGather


# The torch.distributed functions wrappers call from Python, by the kind of traffic each is: DDP's comm hooks
# all-reduce the buckets (compressed or not), ZeRO broadcasts its parameters, DDP's join all-reduces one-element
# flags and broadcasts the final model (coalesced), a pipeline stage sends and receives activations and their
# gradients (isend/irecv, batched or not).
CALLED_KINDS = {"broadcast": "broadcast", "_broadcast_coalesced": "broadcast", "all_reduce": "all_reduce",
                "send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
_paused = threading.local()
# The elements all-reduced by the comm hook this thread is running (None outside one): what _counting_hook reads.
_in_hook = threading.local()


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Leave this thread's torch.distributed calls out of every count: the harness's own traffic (a pipeline's
    gradients broadcast for the report)."""
    _paused.depth = getattr(_paused, "depth", 0) + 1
    try:
        yield
    finally:
        _paused.depth -= 1


@dataclasses.dataclass
class CallCounter:
    """Every call of the functions in ``CALLED_KINDS`` while :meth:`counting`, by kind, with the bytes of the
    tensors handed over. They are replaced in ``torch.distributed`` and in ``distributed_c10d``, where
    ``batch_isend_irecv`` tells a send from a receive by the identity of ``isend``: both namespaces must agree."""

    counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # kind -> [calls, bytes]
    # A comm hook's callbacks (PowerSGD's second all-reduce) may run on the backend's thread.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        namespaces = (dist, dist.distributed_c10d)
        saved = [(space, name, getattr(space, name)) for space in namespaces for name in CALLED_KINDS
                 if hasattr(space, name)]
        counted = {name: self._counting(name, original) for _, name, original in saved}  # one per function
        for space, name, _ in saved:
            setattr(space, name, counted[name])
        try:
            yield
        finally:
            for space, name, original in saved:
                setattr(space, name, original)

    def _counting(self, name: str, original: Callable) -> Callable:
        kind = CALLED_KINDS[name]

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if not getattr(_paused, "depth", 0):
                tensors = (args[1] if len(args) > 1 else kwargs["tensors"]) if name == "_broadcast_coalesced" else \
                    [args[0] if args else kwargs["tensor"]]
                sent = sum(t.numel() * t.element_size() for t in tensors)
                with self.lock:
                    figures = self.counts.setdefault(kind, [0, 0])
                    figures[0] += 1
                    figures[1] += sent
                if kind == "all_reduce" and getattr(_in_hook, "elements", None) is not None:
                    _in_hook.elements += sum(t.numel() for t in tensors)
            return original(*args, **kwargs)

        return counted

    def take(self) -> dict[str, tuple[int, int]]:
        """Every kind's (calls, bytes) since the last call."""
        with self.lock:
            taken = {kind: (calls, sent) for kind, (calls, sent) in self.counts.items() if calls}
            self.counts.clear()
        return taken


@dataclasses.dataclass
class StepTraffic:
    """What one rank communicates per optimizer step: a wrapper's gradient syncs (DDP's comm hook or FSDP2's
    collectives; none for a pipeline) and, by kind, every call made through torch.distributed (DDP's bucket
    all-reduces as its hook makes them, join's flags, ZeRO's broadcasts, a pipeline's sends) besides FSDP2's own."""

    syncs: CommCounter | ShardedCommCounter | None
    calls: CallCounter = dataclasses.field(default_factory=CallCounter)
    last_step: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # kind -> (calls, bytes)

    @property
    def wrappers(self) -> int:
        return self.syncs.wrappers if self.syncs is not None else 0

    @property
    def counts_syncs(self) -> bool:
        return self.syncs is not None

    def counting(self) -> contextlib.AbstractContextManager:
        return self.calls.counting()

    def take(self) -> tuple[int, int]:
        """The syncs and their bytes since the last call (0, 0 where nothing syncs); every kind in ``last_step``."""
        taken = self.syncs.take() if self.syncs is not None else (0, 0)
        self.last_step = dict(self.syncs.last_step) if self.syncs is not None else {}
        add_traffic(self.last_step, self.calls.take())
        return taken


def add_traffic(into: dict[str, tuple[int, int]], more: dict[str, tuple[int, int]]) -> None:
    """Add ``more``'s calls and bytes to ``into``'s, kind by kind (a kind with no call stays out)."""
    for kind, (calls, sent) in more.items():
        if calls:
            before = into.get(kind, (0, 0))
            into[kind] = (before[0] + calls, before[1] + sent)


def attach_counter(module: nn.Module, hook: HookFactory | None = None) -> StepTraffic:
    """The counter for the wrappers inside ``module``: FSDP2's collectives where it holds FSDP modules
    (a regime's, or a team's own wrap), DDP's all-reduces otherwise, through ``hook`` where it is given;
    and every other call they make through torch.distributed."""
    if any(is_fsdp_module(m) for m in module.modules()):
        return StepTraffic(ShardedCommCounter.attach(module))
    return StepTraffic(CommCounter.attach(module, hook))


# What DTensor communicates (tensor parallelism, FSDP2 on a mesh) goes through no torch.distributed function that
# CallCounter replaces: its redistributions call functional collectives (torch.distributed._functional_collectives),
# which are dispatcher ops, and FSDP2's plain calls reach the dispatcher too (c10d's ops). So these are counted where
# every one of them passes, the dispatcher, by op: the functional ops by kind, and c10d's in-place ones.
DISPATCHED_KINDS = {
    "_c10d_functional.all_reduce": "all_reduce", "_c10d_functional.all_reduce_coalesced": "all_reduce",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.all_gather_into_tensor_coalesced": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_c10d_functional.all_to_all_single": "all_to_all", "_c10d_functional.broadcast": "broadcast",
    "_dtensor.shard_dim_alltoall": "all_to_all",
    "c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce",
    "c10d._allgather_base_": "all_gather", "c10d.allgather_": "all_gather", "c10d.allgather_coalesced_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter", "c10d.reduce_scatter_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d.alltoall_": "all_to_all", "c10d.alltoall_base_": "all_to_all", "c10d.broadcast_": "broadcast",
    "c10d.gather_": "gather", "c10d.scatter_": "scatter", "c10d.reduce_": "reduce", "c10d.send": "send",
    "c10d.recv_": "recv", "c10d.recv_any_source_": "recv",
}
# c10d's in-place ops that take their outputs first: what this rank hands over is their second argument.
_OUTPUT_FIRST = {"c10d._allgather_base_", "c10d.allgather_", "c10d.allgather_coalesced_",
                 "c10d.allgather_into_tensor_coalesced_", "c10d._reduce_scatter_base_", "c10d.reduce_scatter_",
                 "c10d.reduce_scatter_tensor_coalesced_", "c10d.alltoall_", "c10d.alltoall_base_", "c10d.gather_",
                 "c10d.scatter_"}


def mesh_dimensions(module: nn.Module, names: tuple[str, ...] = ()) -> dict[tuple[int, ...], str]:
    """Each process group a DTensor of ``module`` lives on (its parameters' meshes), by its ranks, to the name of its
    mesh dimension: the mesh's own (``mesh_dim_names``), else ``names`` (the regime's words for an unnamed mesh's
    dimensions), else ``dim<i>``. By ranks, not by group name: a warm rank that built a mesh before holds groups of the
    same ranks under other names (FSDP2 may shard over one of them), and the ranks are what a dimension is."""
    dims: dict[tuple[int, ...], str] = {}
    meshes = {id(p.device_mesh): p.device_mesh for p in module.parameters() if hasattr(p, "device_mesh")}
    for mesh in meshes.values():
        own = getattr(mesh, "mesh_dim_names", None) or names
        for index in range(mesh.ndim):
            ranks = tuple(dist.get_process_group_ranks(mesh.get_group(index)))
            dims.setdefault(ranks, own[index] if index < len(own) else f"dim{index}")
    return dims


SUB_GROUP_PREFIX = "ranks_"


def sub_group_name(ranks: Iterable[int]) -> str:
    """A group on no dimension of the mesh, by its ranks (``ranks_0_1``), as a count names it and a declaration may."""
    return SUB_GROUP_PREFIX + "_".join(map(str, ranks))


@dataclasses.dataclass
class DispatchedCounter(CallCounter):
    """Every collective that reaches the dispatcher while :meth:`counting` on this thread (DTensor's functional
    collectives, FSDP2's and torch.distributed's c10d ops), by kind and mesh dimension: ``"all_reduce[tp]"``, with
    the bytes of the tensors this rank hands over. A group on no dimension of ``dims`` is named by its ranks
    (``"all_to_all[ranks_0_1]"``: a team's own sub-group, declared by that name). The harness's own read-back (``DTensor.full_tensor`` for the report) is left out, as
    :func:`uncounted` leaves out any other."""

    dims: dict[tuple[int, ...], str] = dataclasses.field(default_factory=dict)  # a group's ranks -> mesh dimension

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from torch.distributed.tensor import DTensor

        read_back = DTensor.full_tensor

        @functools.wraps(read_back)
        def full_tensor(tensor, *args, **kwargs):
            with uncounted():
                return read_back(tensor, *args, **kwargs)

        DTensor.full_tensor = full_tensor
        try:
            with _Dispatched(self):
                yield
        finally:
            DTensor.full_tensor = read_back

    def count(self, func, args: tuple, kwargs: dict) -> None:
        name = func._schema.name.replace("::", ".")
        kind = DISPATCHED_KINDS.get(name)
        if kind is None or getattr(_paused, "depth", 0):
            return
        values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        group = values.get("group_name", values.get("process_group"))
        if isinstance(group, torch.ScriptObject):  # c10d's ops take the group boxed
            group = dist.ProcessGroup.unbox(group)
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
        where = "world" if ranks is None else self.dims.get(ranks, sub_group_name(ranks))
        handed = args[1] if name in _OUTPUT_FIRST else args[0]
        tensors = [t for t in torch.utils._pytree.tree_leaves(handed) if isinstance(t, torch.Tensor)]
        sent = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            figures = self.counts.setdefault(f"{kind}[{where}]", [0, 0])
            figures[0] += 1
            figures[1] += sent


def _dispatch_mode() -> type:
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        """Sees every op; a DTensor's it hands back to DTensor first (NotImplemented, as torch's CommDebugMode does),
        so that the collectives DTensor makes of it reach this mode as plain tensors' ops."""

        def __init__(self, counter: DispatchedCounter) -> None:
            super().__init__()
            self.supports_higher_order_operators = True
            self.counter = counter

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t is DTensor or issubclass(t, DTensor) for t in types):
                return NotImplemented
            self.counter.count(func, args, kwargs)
            return func(*args, **kwargs)

    return Dispatched


def _Dispatched(counter: DispatchedCounter):  # noqa: N802 - a mode made on first use: DTensor is imported only then
    return _dispatch_mode()(counter)


def attach_mesh_counter(module: nn.Module, names: tuple[str, ...] = (), layout: dict[str, int] | None = None
                        ) -> StepTraffic:
    """The counter for a model on a device mesh (tensor parallelism, with FSDP2 or not): no gradient sync counted
    (tensor parallelism synchronises activations, not gradients), every collective by kind and mesh dimension: the
    dimensions of the module's DTensors, or of the mesh ``layout`` gives (its sizes by name, row-major)."""
    dims = mesh_groups(layout) if layout is not None else mesh_dimensions(module, names)
    return StepTraffic(None, DispatchedCounter(dims=dims))


def mesh_groups(layout: dict[str, int]) -> dict[tuple[int, ...], str]:
    """The ranks of every group of a row-major mesh of ``layout`` (dimension sizes by name), to its dimension's name;
    a dimension of one rank has no group worth a name. A group of every rank that no one dimension spans is the
    ``world`` (FSDP2 over a dp x ep mesh's ranks)."""
    shape = tuple(layout.values())
    grid = torch.arange(math.prod(shape)).reshape(shape)
    every = {tuple(range(grid.numel())): "world"} if grid.numel() > 1 else {}
    return every | {tuple(group): name for axis, (name, size) in enumerate(layout.items()) if size > 1
                    for group in grid.movedim(axis, -1).reshape(-1, size).tolist()}
