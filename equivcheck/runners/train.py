"""Training: a case under one regime, in this process, from the seeded start, recording everything.

On a worker rank this is what each rank runs; :mod:`equivcheck.runners.dispatch` decides where a run goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from ..case import Batch, Case, Objective
from . import anchors, checkpoints, clipping
from .request import RunRequest
from .closure import evaluate_closure
from .tracing import Modules, TraceComplete, traced, tracing
from ..judge.compare import Expected
from ..judge.witness import backward_scale
from ..diff import SCALER_PREFIX, Measurement
from ..errors import InvalidArgument, NonFinite, Unavailable, exits_as_errors
from ..measure.activation import activation_meter
from ..measure.collectives import add_traffic
from ..measure.state import held_bytes, optimizer_state_bytes
from .. import device as devices
from ..device import deterministic
from ..precision import Precision, resolve_precision
from ..regimes import CommunicationCounter, Regime
from ..regimes.base import step_hooks
from ..result import RunResult
from ..process.seeding import DEFAULT_SEED, default_dtype, seeded
from ..process import progress
from ..process import threads as intra_op


def train(
    case: Case | str,
    regime: Regime | str,
    *,
    seed: int = DEFAULT_SEED,
    dtype: str | torch.dtype | Precision | None = None,
    measure_memory: bool = True,
    threads: int | None = None,
    order: str = "given",
    against: Expected | None = None,
    device: str | torch.device | None = None,
) -> RunResult:
    """Train ``case`` for its steps under ``regime`` in precision ``dtype`` (default: the case's dtype)
    and return what it produced, with its peak activation memory unless ``measure_memory`` is off;
    with ``threads`` intra-op threads (default: one, unless the user chose: see :mod:`equivcheck.process.threads`);
    with each global batch's samples in ``order`` (``'given'``; ``'reversed'`` or ``'rolled'``, or ``'rescaled_0.7'``
    and the like, its backward at another scale: a witness, :mod:`equivcheck.judge.witness`); on ``device``
    (default: the CPU, equivcheck.device). ``against`` compares the run with a reference as it trains, keeping the
    differences and none of its tensors: what a check needs of a run, in a recording's memory less
    (:mod:`equivcheck.judge.compare`)."""
    request = RunRequest.of(case, regime, seed=seed, dtype=dtype, measure_memory=measure_memory, threads=threads,
                            order=order, device=device)
    return run_request(request, against)


def run_request(request: RunRequest, against: Expected | None = None) -> RunResult:
    """The run ``request`` asks for, its arguments checked when it was made; on a precision's kernel path, decided by
    a check before its runs, or probed here for a lone run."""
    device = request.regime.device(request.device)
    missing = request.precision.unavailable(device.type)
    if missing:
        raise Unavailable(f"dtype={request.precision.name!r} cannot run here: {missing}")
    request = dataclasses.replace(request, precision=request.precision.with_kernels(device.type))
    run = functools.partial(_train, request, device, against=against)
    # None: something wrote to a gradient the recording kept after its step had used it: train again, copying each.
    with exits_as_errors(), deterministic(device.type):
        return run(keeps_gradients=request.regime.releases_gradients) or run(keeps_gradients=False)


def _train(request: RunRequest, device: torch.device, *, against: Expected | None,
           keeps_gradients: bool) -> RunResult | None:
    """One run's stages in their order: build what the case trains, assemble it under the regime, train the segment
    (every batch), read back what it produced. None where the recording was written to after its step (run_request
    trains again, copying)."""
    started = time.perf_counter()
    with intra_op.using(request.threads), seeded(request.seed), default_dtype(request.precision.dtype), \
            request.precision.kernel_path.applied(), clipping.scaled(request.case.clip_scale):
        built = build(request, device)
        torch.set_num_threads(intra_op.for_model(request.threads, request.wide_threads,
                                                 sum(p.numel() for p in built.model.parameters())))
        restart = request.restart
        if restart is not None:  # a resume's segment: its share of the batches, the checkpoint restored or saved
            built = dataclasses.replace(built, batches=restart.batches(built.batches))
        assembled = assemble(request.regime, built)
        if restart is not None and restart.load_from is not None:
            checkpoints.restore(restart.load_from, assembled, built.objective.scaler)
        segment = train_segment(request, assembled, against, keeps_gradients)
        if restart is not None and restart.save_to is not None:
            checkpoints.save(restart.save_to, assembled, built.objective.scaler)
    if not segment.recorder.intact():
        return None
    return result_of(request, assembled, segment, against, started)


@dataclasses.dataclass
class Built:
    """What a run trains, before any regime touched it: the case (counting its tokens where its loss does), the model
    on its device, the global batches, the objective."""

    case: Case
    model: nn.Module
    batches: list[Batch]
    objective: Objective


def build(request: RunRequest, device: torch.device) -> Built:
    """The model and the batches from the seeded start, drawn in the precision's draw dtype, on ``device``."""
    case, precision = request.case, request.precision
    with default_dtype(precision.draw_dtype or precision.dtype):
        model = build_model(case, precision, device)
        batches = [reordered(batch, request.order) for batch in load_batches(case, precision, device)]
    objective = Objective(case, precision, device)
    counted = objective.counted_by_its_loss(model, batches[0])
    if counted is not case:  # a per-token loss without items=: every batch counts its tokens
        case, objective = counted, Objective(counted, precision, device)
        batches = [dataclasses.replace(batch, count=case.items) for batch in batches]
    return Built(case, model, batches, objective)


@dataclasses.dataclass
class Assembled:
    """A built run under its regime: the module the regime drives, the model it optimises, records and reads back
    (what the wrap returned, where that holds parameters of its own), the optimizer made over that model, and the
    counter of what the wrappers communicate, and the case's scheduler over that optimizer (None: it has none)."""

    built: Built
    regime: Regime
    module: nn.Module
    model: nn.Module
    optimizer: Optimizer
    counter: CommunicationCounter | None
    scheduler: object | None = None


def assemble(regime: Regime, built: Built) -> Assembled:
    """Wrap first (a sharding wrapper replaces the parameters the optimizer holds), then the optimizer over what the
    wrap returns (the case's scheduler over it), then the communication counter on the wrappers."""
    module = regime.wrap(built.model, built.objective)
    model = trained_model(built.model, module)
    optimizer = regime.build_optimizer(built.case, model)
    return Assembled(built, regime, module, model, optimizer, regime.count_communication(module),
                     built.case.build_scheduler(optimizer))


@dataclasses.dataclass
class Segment:
    """What training a run's batches produced: the losses, the recording (gradients, counts, norms), the activation
    meter and the watch over which batch took which step."""

    losses: tuple[float | None, ...]
    recorder: GradRecorder
    memory: object
    watched: StepWatch
    traces: tuple = ()  # a replay's trace of its step (runners/tracing.py)


def train_segment(request: RunRequest, assembled: Assembled, against: Expected | None,
                  keeps_gradients: bool) -> Segment:
    """The regime's training over the built batches, every optimizer step recorded (or compared with ``against``)."""
    regime, model, optimizer, built = assembled.regime, assembled.model, assembled.optimizer, assembled.built
    batches = built.batches
    data = [t for batch in batches for t in (batch.inputs, batch.targets)]
    parameters = case_named(model.named_parameters())
    # An anchored check's reference keeps its recording in its GPU's memory where it holds it, else in files.
    held = bool(request.anchor_to) and anchors.held_on(parameters[0][1].device, parameters, len(batches))
    spill = os.path.join(request.anchor_to, "recording") if request.anchor_to and not held else ""
    with GradRecorder(model, optimizer, assembled.counter, regime, against, norms=regime.clips_at() is not None,
                      keeps=keeps_gradients, per_call=regime.counts_per_call and regime.steps_observable,
                      home=parameters[0][1].device if held else None, spill=spill) \
            as recorder, \
            activation_meter(model, data, enabled=request.measure_memory) as memory, \
            scheduled(optimizer, assembled.scheduler), \
            rescaled_backward(model, backward_scale(request.order)), \
            tracing(lambda: traced_modules(model, assembled.module), case_named(model.named_parameters()), optimizer, regime,
                    request.trace_steps, request.restart.start if request.restart is not None else 0,
                    saves=request.restart is not None and request.restart.save_to is not None,
                    calls=request.trace_modules) as tracer, \
            anchored(request, assembled, recorder, held):
        watched = StepWatch(batches, recorder)
        with regime.random_streams(model, optimizer, [batch.inputs for batch in batches]), \
                eager_twin(request.trace_eager, lambda: traced_modules(model, assembled.module)):
            try:
                losses = tuple(None if loss is None else float(loss)
                               for loss in regime.train(assembled.module, optimizer,
                                                        watched if regime.steps_observable else batches,
                                                        built.objective))
            except TraceComplete:  # a replay stops after the step it traced: its losses are not read
                losses = ()
    return Segment(losses, recorder, memory, watched, traced(tracer))


@contextlib.contextmanager
def anchored(request: RunRequest, assembled: Assembled, recorder: GradRecorder, held: bool) -> Iterator[None]:
    """While training: the state each step starts from saved (``request.anchor_to``: the reference; in its device's
    memory where ``held``), or each step started from the reference's saved state (``against.anchors``: the
    candidate, the recorder comparing each update); neither, nothing."""
    model, optimizer = assembled.model, assembled.optimizer
    parameters, buffers = case_named(model.named_parameters()), case_named(model.named_buffers())
    if request.anchor_to:
        with anchors.saving(request.anchor_to, parameters, buffers, model, optimizer, held):
            yield
    elif recorder.against is not None and recorder.against.anchors:
        with anchors.Anchoring(recorder.against.anchors, parameters, buffers, model, optimizer, recorder.measurement,
                               recorder.against.reference.optimizer_steps) as anchoring:
            recorder.anchoring = anchoring
            yield
    else:
        yield


@contextlib.contextmanager
def scheduled(optimizer: Optimizer, scheduler) -> Iterator[None]:
    """While training: ``scheduler`` (where there is one) stepped after every step ``optimizer`` takes, whoever calls
    it. A schedule follows optimizer steps, so a step a GradScaler skips leaves it be; outside training it stands
    still (torch.distributed.checkpoint creates an optimizer's state with a step at rate 0 of its own)."""
    if scheduler is None:
        yield
        return
    handles = step_hooks(optimizer, after=lambda *_: scheduler.step())
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def result_of(request: RunRequest, assembled: Assembled, segment: Segment, against: Expected | None,
              started: float) -> RunResult:
    """The run's result: the final weights and buffers whole (or compared with ``against`` as they are read), checked
    finite, with everything the recording and the meters noted."""
    regime, model, counter, built = assembled.regime, assembled.model, assembled.counter, assembled.built
    recorder, losses, memory, watched = segment.recorder, segment.losses, segment.memory, segment.watched
    counts_syncs = counter is not None and counter.counts_syncs  # a pipeline counts traffic, but no sync
    held = (held_bytes(model.parameters()), recorder.grad_bytes,
            optimizer_state_bytes(regime.local_optimizer(assembled.optimizer)))
    named_buffers = [(n, b) for n, b in case_named(model.named_buffers()) if b.is_floating_point() or b.is_complex()]
    if built.objective.scaler.is_enabled() and regime.harness_scaler:
        named_buffers += scaler_state(built.objective.scaler)
    if against is None:
        # The final state is no copy: the model is done with once this returns, and nothing writes to it again.
        weights = snapshot(regime.read_back(dict(case_named(model.named_parameters()))).items(), copy=False,
                           home=recorder.home)
        buffers = snapshot(named_buffers, regime.full_tensor, copy=False, home=recorder.home)
        if recorder.spill:
            weights, buffers = (anchors.OnDisk(os.path.join(recorder.spill, name), named)
                                for name, named in (("weights", weights), ("buffers", buffers)))
        ensure_finite(str(regime), losses, recorder.grads, weights)
    else:
        weights = buffers = {}
        recorder.measure_final(case_named(model.named_parameters()), named_buffers)
        ensure_finite(str(regime), losses, (), {})
    return RunResult(
        case=built.case.name,
        regime=str(regime),
        losses=losses,
        grads=tuple(recorder.grads),
        weights=weights,
        buffers=buffers,
        seconds=time.perf_counter() - started,
        syncs=tuple(recorder.syncs) if counts_syncs else None,
        sync_bytes=tuple(recorder.sync_bytes) if counts_syncs else None,
        collectives=None if counter is None else tuple(recorder.collectives),
        sync_wrappers=counter.wrappers if counts_syncs else None,
        steps_per_batch=watched.steps_per_batch(len(recorder.grads)) if regime.steps_observable else None,
        precision=request.precision.name,
        peak_activation_bytes=memory.peak,
        memory_method=memory.method,
        loss_dtypes=tuple(sorted(str(dtype) for dtype in built.objective.loss_dtypes)),
        batch_samples=tuple(len(batch) for batch in built.batches),
        state_bytes=held,
        grad_norms=tuple(recorder.grad_norms),
        rank_spread=recorder.rank_spread,
        rank_drift=recorder.rank_drift,
        measured=recorder.measurement,
        traces=segment.traces,
    )


def trained_model(model: nn.Module, module: nn.Module) -> nn.Module:
    """What a run optimises, records and reads back: the case's model, which a wrap may hold (DDP, FSDP2 in place, a
    container of wrapped parts), or what the wrap returned in its place where that holds parameters of its own (a
    team's Megatron-style conversion builds new layers: the originals are never used again)."""
    if module is model or {id(p) for p in module.parameters()} == {id(p) for p in model.parameters()}:
        return model
    return module.module if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else module


@contextlib.contextmanager
def eager_twin(eager: bool | tuple[str, ...], modules: Modules) -> Iterator[None]:
    """While training: torch.compile's code run uncompiled where ``eager`` (a failed compiled run's eager twin, which
    the localizer replays from the same state), or only the forwards of the ``modules`` it names (a graph break
    around each: which module's compiled form makes the difference), else as it is."""
    if not eager:
        yield
        return
    import torch._dynamo

    if eager is True:
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    named = dict(modules())
    uncompiled = [(named[name], vars(named[name]).get("forward")) for name in eager if name in named]
    for module, _ in uncompiled:
        module.forward = torch._dynamo.disable(module.forward)
    try:
        yield
    finally:
        for module, own in uncompiled:  # the forward it had: its class's, or one set on it
            if own is None:
                del module.forward
            else:
                module.forward = own


def traced_modules(model: nn.Module, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a run may call, named as the case's model names them: the model's own, then those the regime
    drives that it does not hold (a new root a team's parallelize returned, its own parallel layer in place of the
    case's), by their place in what the regime drives (under a wrapper that holds the model, their place in it)."""
    named = case_named(model.named_modules())
    if module is model:
        return named
    held = {id(each) for _, each in named}
    inner = next((path for path, each in module.named_modules() if each is model), None)
    prefix = f"{inner}." if inner else ""
    for path, each in case_named(module.named_modules()):
        if id(each) not in held and (inner is None or path.startswith(prefix)):
            named.append((path[len(prefix):], each))
    return named


def scaler_state(scaler) -> list[tuple[str, Tensor]]:
    """A GradScaler's state as the buffers it acts as: its scale and how many clean steps it has counted towards its
    next growth; a run that lost them (a resume without them) scales its later steps otherwise."""
    state = scaler.state_dict()
    return [(f"{SCALER_PREFIX}scale", torch.tensor(float(state["scale"]), dtype=torch.float64)),
            (f"{SCALER_PREFIX}growth_tracker", torch.tensor(float(state["_growth_tracker"]), dtype=torch.float64))]


COMPILED_PREFIX = "_orig_mod."  # what torch.compile's OptimizedModule adds to the names of what it wraps


def case_named(named) -> list[tuple[str, Tensor]]:
    """A trained model's named parameters (or buffers) under the names the case's model gives them: a block compiled
    and registered in its own place (``torch.compile(block)``, as torchtitan compiles each block) holds the same
    tensors under ``_orig_mod.`` names."""
    return [(name.replace(COMPILED_PREFIX, ""), tensor) for name, tensor in named]


def dense(tensor: Tensor) -> Tensor:
    """``tensor`` as a strided tensor: a sparse gradient densified (the tensor it adds to a parameter)."""
    return tensor.to_dense() if tensor.layout != torch.strided else tensor


def ensure_finite(regime: str, losses: Sequence[float | None], grads: Sequence[dict[str, Tensor]],
                  weights: dict[str, Tensor]) -> None:
    """A NaN or an infinity is an error of its own: it compares unequal even to itself, and would
    otherwise read as a reference that disagrees with itself, or as a regime's mismatch."""
    for step, loss in enumerate(losses):
        if loss is not None and not math.isfinite(loss):
            raise NonFinite(f"non-finite loss ({loss}) at step {step} under {regime}")
    for step, named in enumerate(grads):
        for name, grad in named.items():
            if not finite(grad):
                raise NonFinite(f"non-finite gradient of {name!r} at step {step} under {regime}")
    for name, weight in weights.items():
        if not finite(weight):
            raise NonFinite(f"non-finite weight {name!r} after the last step under {regime}")


def finite(tensor: Tensor) -> bool:
    """Whether every element is finite, in one reduction and no temporary of the tensor's size: a NaN
    anywhere makes the minimum and the maximum NaN, an infinity is one of them."""
    if not tensor.numel() or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    if tensor.is_complex():  # no order: element by element
        return bool(torch.isfinite(tensor).all())
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def build_model(case: Case, precision: Precision | None = None, device: torch.device | str = "cpu") -> nn.Module:
    precision = precision or resolve_precision(None, default=case.dtype)
    model = case.model()
    if not isinstance(model, nn.Module):
        raise InvalidArgument.type("model", model, "a factory returning a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidArgument(f"model of case {case.name!r} has no trainable parameters: expected at least one")
    return precision.prepare(model, device).train()


def initial_weights(case: Case, precision: Precision, seed: int, device: str) -> dict[str, Tensor]:
    """The weights every run of ``case`` on ``device`` starts from, built as :func:`train` builds them: where a run
    moved an element whose true gradient is zero, it moved by rounding alone (witness.py)."""
    with seeded(seed), default_dtype(precision.draw_dtype or precision.dtype):
        model = build_model(case, precision, torch.device(device))
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}




def reordered(batch: Batch, order: str) -> Batch:
    """``batch`` with its samples in ``order``: as given, reversed, or rolled by half. The mean over a global batch's
    items does not depend on the order of its samples, so only the summation order (rounding) changes. A rescaled
    witness keeps them as given (:func:`rescaled_backward`)."""
    if order == "given" or backward_scale(order) is not None:
        return batch
    index = torch.arange(len(batch) - 1, -1, -1) if order == "reversed" else torch.arange(len(batch)).roll(len(batch) // 2)
    return dataclasses.replace(batch, inputs=batch.inputs[index], targets=batch.targets[index])


@contextlib.contextmanager
def rescaled_backward(model: nn.Module, scale: float | None) -> Iterator[None]:
    """Every backward of this run from a loss multiplied by ``scale`` (None: as it is), and each parameter's gradient
    divided by it as it reaches the parameter, before anything (accumulation, clipping, a GradScaler, the optimizer)
    reads it: the same maths, rounded otherwise at every step of the backward. Where reordering a tiny batch's
    samples changes no rounding that matters, this does: a reference whose tiny true gradients take their sign from
    rounding (Adam without epsilon) parts from itself as a regime that splits the batch does (witness.py). A gradient
    that reaches a parameter by another path than ``Tensor.backward`` (``torch.autograd.grad``) comes out divided:
    its step 0 differs, and the witness is then no witness (``witness._diverging``)."""
    if scale is None:
        yield
        return
    plain = torch.Tensor.backward

    def backward(tensor: Tensor, gradient: Tensor | None = None, *args, **kwargs) -> None:
        gradient = torch.ones_like(tensor) if gradient is None else gradient
        return plain(tensor, gradient * scale, *args, **kwargs)

    handles = [parameter.register_hook(lambda grad: grad / scale)
               for parameter in dict.fromkeys(model.parameters()) if parameter.requires_grad]
    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = plain
        for handle in handles:
            handle.remove()


def load_batches(case: Case, precision: Precision | None = None, device: torch.device | str = "cpu") -> list[Batch]:
    """The case's data cut into ``steps`` global batches (the last one smaller where the case keeps a
    smaller last batch), repeated for each epoch; wrong sizes are errors, never truncated."""
    precision = precision or resolve_precision(None, default=case.dtype)
    data = case.data()
    if not (isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, Tensor) for t in data)):
        raise InvalidArgument.type("data", data, "a factory returning a tuple (inputs, targets) of tensors")
    inputs, targets = data
    if len(inputs) != len(targets):
        raise InvalidArgument(
            f"data of case {case.name!r}: inputs hold {len(inputs)} samples and targets {len(targets)}: "
            "expected the same number on dim 0"
        )
    first_of_last = case.samples - case.batch_size + 1 if case.last_batch == "keep" else case.samples
    if not first_of_last <= len(inputs) <= case.samples:
        raise InvalidArgument(f"data of case {case.name!r} holds {len(inputs)} samples: {_expected_samples(case, len(inputs))}")
    inputs, targets = (t.to(device=device, dtype=precision.rounded_to or precision.dtype).to(precision.dtype)
                       if t.is_floating_point()
                       else t.to(device) for t in (inputs, targets))
    epoch = [Batch(inputs[i : i + case.batch_size], targets[i : i + case.batch_size], case.items)
             for i in range(0, len(inputs), case.batch_size)]
    return epoch * case.epochs  # every epoch goes over the same batches in the same order


def _expected_samples(case: Case, held: int) -> str:
    """What a case's data must hold, with the figures (nothing is ever truncated or padded)."""
    if case.last_batch == "exact":
        return (f"expected exactly steps * batch_size = {case.steps} * {case.batch_size} = {case.samples} "
                "(nothing is truncated or padded); last_batch='keep' allows a smaller last global batch")
    return (f"with last_batch='keep', expected {case.samples - case.batch_size + 1} to {case.samples}: "
            f"steps={case.steps} global batches of batch_size={case.batch_size}, the last one holding the "
            f"remainder; {held} samples make {math.ceil(held / case.batch_size)} global batches: declare "
            f"steps={math.ceil(held / case.batch_size)} (steps counts the last, smaller batch too)")


class StepWatch(list):
    """The global batches, noting how many optimizer steps had been taken when each was handed out, so a
    report can say which batch took how many (a step per micro-batch in the last one only: 1, 1, 4)."""

    def __init__(self, batches: list[Batch], recorder: GradRecorder) -> None:
        super().__init__(batches)
        self._recorder, self._marks = recorder, []

    def __iter__(self):
        for index, batch in enumerate(super().__iter__()):
            if index:  # the code that took the last batch has asked for the next: its call is over
                self._recorder.end_call()
            self._marks.append(len(self._recorder.grads))
            yield batch

    def steps_per_batch(self, total: int) -> tuple[int, ...] | None:
        """Steps taken per global batch, or None where the batches were not taken once each, in turn."""
        if len(self._marks) != len(self):
            return None
        bounds = [*self._marks, total]
        return tuple(after - before for before, after in zip(bounds, bounds[1:]))


class GradRecorder:
    """Snapshot every parameter's gradient as each ``optimizer.step`` uses it, whoever calls it, and,
    under a parallel wrapper, what was communicated from the end of the previous step to the end of this
    one (ZeRO broadcasts parameters inside its step; what follows the last step, join's closing rounds,
    counts in the last). A step given a closure has its closure run first (see :mod:`equivcheck.runners.closure`):
    its backward belongs to the step. ``against``: each gradient is compared with the reference's as the step
    takes it, and none is kept; ``norms``: each step's global gradient norm is noted (a clipping regime's);
    ``keeps``: the recording keeps the CPU gradients the step used, not copies (a regime that lets go of them after
    each step: ``Regime.releases_gradients``), and :meth:`intact` says whether anything wrote to them since;
    ``per_call``: communication is counted per call of a team's step (from one global batch handed out to the next,
    :class:`StepWatch`), not per optimizer step, so what the step does after ``optimizer.step()`` counts with it."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, counter: CommunicationCounter | None = None,
                 regime: Regime | None = None, against: Expected | None = None,
                 norms: bool = False, keeps: bool = False, per_call: bool = False,
                 home: torch.device | None = None, spill: str = "") -> None:
        self._named = case_named(model.named_parameters())
        self.home = home or devices.HOST  # where the recording is kept: the run's device, where it holds it
        self.spill = spill  # else a folder: the recording goes to files there (anchors.OnDisk)
        self._per_call = per_call
        self._regime = regime or Regime()  # reads tensors back whole (Regime.read_back, Regime.full_tensor)
        self._optimizer = optimizer
        self._counter = counter
        self._against, self._norms, self._keeps = against, norms, keeps
        self.anchoring: anchors.Anchoring | None = None  # each step started from the reference's (anchored())
        self._kept: list[tuple[Tensor, int]] = []  # each gradient kept, with its version when its step used it
        self.measurement = None if against is None else Measurement(against.tolerance)
        self.grad_norms: list[float] = []
        self.rank_spread: float | None = None  # measured on the ranks by a run compared as it trains
        self.rank_drift = ""
        self.grads: list[dict[str, Tensor]] = []
        self.syncs: list[int] = []
        self.sync_bytes: list[int] = []
        self.collectives: list[dict[str, tuple[int, int]]] = []
        self.grad_bytes = 0  # the gradient bytes this rank held at the last step

    def __enter__(self) -> GradRecorder:
        self._exits = contextlib.ExitStack()
        counts_after = self._counter is not None and not self._per_call
        for handle in step_hooks(self._optimizer, self._before_step, self._after_step if counts_after else None):
            self._exits.callback(handle.remove)
        if self._counter is not None:
            self._exits.enter_context(self._counter.counting())
            self._exits.callback(self._count_the_tail)  # runs first: the counting is still on
        return self

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        progress.note()  # a step: the run is alive, however long it is (a timeout measures silence)
        call = evaluate_closure(args, kwargs)
        self.grad_bytes = held_bytes(p.grad for _, p in self._named)
        # A parameter that took no part in the step has no gradient: mathematically a zero one. A sparse gradient (a
        # sparse nn.Embedding's) is compared as the dense tensor it stands for.
        grads = self._regime.read_back({n: dense(p.grad.detach()) if p.grad is not None else torch.zeros_like(p)
                                 for n, p in self._named})
        if self._norms:
            self.grad_norms.append(math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=_wide(g))) ** 2
                                                 for g in grads.values())))
        if self.measurement is None:
            self.grads.append(self._kept_or_copied(grads))
        else:
            self._measure("grad", len(self.grads), grads)
            self.grads.append({})
        return call

    def _kept_or_copied(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The step's gradients as the recording holds them: the tensors themselves where the regime lets go of them
        (an in-place write bumps a tensor's version, which :meth:`intact` reads), else plain CPU copies."""
        if self.spill:
            return anchors.OnDisk(os.path.join(self.spill, f"grads-{len(self.grads)}"), grads)
        if not (self._keeps and all(g.device == self.home for g in grads.values())):
            return snapshot(grads.items(), home=self.home)
        self._kept += [(g, g._version) for g in grads.values()]
        return grads

    @property
    def against(self) -> Expected | None:
        """What this run is compared with as it trains (None: it is recorded)."""
        return self._against

    def intact(self) -> bool:
        """Whether every gradient kept without a copy still holds what its step used."""
        return all(g._version == version for g, version in self._kept)

    def _measure(self, kind: str, step: int | None, tensors: dict[str, Tensor]) -> None:
        """Compare with the reference's (``'grad'`` at ``step``, or a final ``'weight'`` or ``'buffer'``). Nothing is
        read for finiteness: within tolerance of the reference's (which is finite) is finite, and a run beyond it is
        trained again, recorded, for its breakdown (check.py), where the error is raised as a recorded run raises it."""
        reference = self._against.reference
        if kind == "grad":
            self.measurement.add(kind, step, tensors, reference.grads[step] if step < len(reference.grads) else {})
        else:
            self.measurement.add_final(kind, tensors, reference.weights if kind == "weight" else reference.buffers)

    def measure_final(self, parameters, buffers) -> None:
        """The final weights and buffers compared with the reference's (a run compared as it trains), and, on ranks,
        how far each rank's weights ended from rank 0's."""
        weights = self._regime.read_back({n: t.detach() for n, t in parameters})
        if self.anchoring is None or not self.anchoring.compared_final:
            self._measure("weight", None, weights)  # anchored, the last update was compared as the final weights
        self._measure("buffer", None, {n: self._regime.full_tensor(t.detach(), n) for n, t in buffers})
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank_spread, self.rank_drift = rank_spread(weights)

    def _after_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        self._take_count()

    def end_call(self) -> None:
        """A call of a team's step is over: what it communicated is one count (``per_call``)."""
        if self._per_call and self._counter is not None:
            self._take_count()

    def _take_count(self) -> None:
        syncs, sent = self._counter.take()
        self.syncs.append(syncs)
        self.sync_bytes.append(sent)
        self.collectives.append(dict(self._counter.last_step))

    def _count_the_tail(self) -> None:
        """What was communicated after the last step (join's closing rounds) belongs to the last step; counted per
        call, it is the last call's."""
        if self._per_call:
            self._take_count()
            return
        self._counter.take()
        if self.collectives:
            add_traffic(self.collectives[-1], self._counter.last_step)

    def __exit__(self, *exc: object) -> None:
        self._exits.close()



def rank_spread(weights: dict[str, Tensor]) -> tuple[float, str]:
    """The greatest difference of any rank's final weights from rank 0's (DDP keeps replicas identical: 0), and where
    (:func:`drift_place`); rank 0's broadcast one tensor at a time, after training, so no regime's communication
    count sees it."""
    local, name = 0.0, ""
    for weight_name, weight in weights.items():
        theirs = weight.clone() if dist.get_rank() == 0 else torch.empty_like(weight)
        dist.broadcast(theirs, 0)
        if weight.numel():
            apart = float((weight - theirs).abs().max())
            if apart > local:
                local, name = apart, weight_name
    every: list[tuple[float, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (local, name))
    spread, rank = max((apart, rank) for rank, (apart, _) in enumerate(every))
    return spread, drift_place(every[rank][1], rank) if spread else ""


def drift_place(name: str, rank: int) -> str:
    return f"{name!r}, rank {rank} against rank 0"


def _wide(tensor: Tensor) -> torch.dtype:
    """The float64 a norm sums in: complex128 for a complex tensor, whose norm torch takes only in a complex dtype."""
    return torch.complex128 if tensor.is_complex() else torch.float64


def snapshot(named, full_tensor: Callable[[Tensor, str], Tensor] = lambda t, name: t, *,
             copy: bool = True, home: torch.device | None = None) -> dict[str, Tensor]:
    """Plain tensors of the whole tensors (gathered by ``full_tensor`` where a wrapper shards them) on ``home``
    (default: the host's memory, whatever device the run used): copies, unless ``copy=False`` says nothing will write
    to the originals again."""
    home = home or devices.HOST
    return {name: full_tensor(tensor.detach(), name).to(home, copy=copy) for name, tensor in named}
