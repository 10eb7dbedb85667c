"""Tracing optimizer steps at their module boundaries, for saying where a failed run parts from its reference.

A check that failed replays the first step that parts and the one before it, in the reference and in the candidate,
with this tracer on (``RunRequest.trace_steps``). A step's window opens after the optimizer's previous step and
closes when the optimizer reads the step's gradients: every module call in between is recorded (inputs, outputs, and
through tensor hooks the gradients of each), with what backward delivered to each parameter, the gradients the
optimizer read, the weights and the optimizer's state the step started from. A run in one process then stops: its
replay costs the steps up to the one that parts, never the whole training again. Ranks train on to the end (a rank that stopped alone inside a join or a pipeline schedule would leave the others
waiting), and read the weights where they are in step with each other: at the optimizer's hooks.

Hooks observe and never change a value: an input is seen through ``view_as`` (an identity view, so that the
gradient this module alone sends to it can be caught), every record is a copy. A hook that cannot record a call
notes why in the trace and lets training go on.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..measure.collectives import uncounted
from ..process.torch_imports import is_dtensor
from ..regimes import Regime
from ..regimes.base import step_hooks
from ..trace import ModuleCall, StepTrace


class TraceComplete(Exception):
    """The traced step is over: the run stops there (train.py reads the trace)."""


# the model's modules as it holds them when called, the root first, named as the case's model names them
Modules = Callable[[], list[tuple[str, nn.Module]]]


@contextlib.contextmanager
def tracing(modules: Modules, parameters: list[tuple[str, Tensor]], optimizer: Optimizer,
            regime: Regime, steps: tuple[int, ...], offset: int = 0, saves: bool = False,
            calls: bool = True) -> Iterator[StepTracer | None]:
    """While training: the optimizer steps ``steps`` of this run traced (none: nothing traced, nothing hooked), each
    trace numbered ``offset`` on (a resume's later segment counts its steps from its first batch). ``modules``: the
    model's as the step finds it (read again at each call of the model: a module the step swaps in is traced by the
    place it holds); ``parameters``: the model's, named as the case's model names them. A run that ``saves`` a checkpoint for the next
    segment trains to its end: stopped after its traced step, it would save (or a team's loop would leave) other
    state than the run it replays, and the next segment would resume from that. Without ``calls`` no module is
    hooked, only the parameters and the optimizer: code whose behaviour module hooks change (a compiled step that
    traces them) trains as it did."""
    if not steps:
        yield None
        return
    tracer = StepTracer(modules, parameters, optimizer, regime, steps, offset, stops=not saves, calls=calls)
    with tracer:
        yield tracer


class StepTracer:
    """Records optimizer steps ``steps`` of a run over ``modules`` (their ``calls`` too, else their buffers alone)
    and ``parameters`` (the case's model's, as the regime trains it), a :class:`StepTrace` each in :attr:`traces`."""

    def __init__(self, modules: Modules, parameters: list[tuple[str, Tensor]],
                 optimizer: Optimizer, regime: Regime, steps: tuple[int, ...], offset: int = 0,
                 stops: bool = True, calls: bool = True) -> None:
        self._optimizer, self._regime = optimizer, regime
        self._steps, self._offset = frozenset(steps), offset
        self._modules, self._parameters, self._hooks_calls = modules, parameters, calls
        # each hooked module's place in the model, as the model held it last, by id; and the modules themselves, kept
        # alive while traced: a module the step dropped, freed, could leave its id to one it swaps in later
        self._names: dict[int, str] = {}
        self._hooked: list[nn.Module] = []
        self._strangers: dict[int, nn.Module] = {}  # modules called that the model did not hold when last read
        self._steps_taken = 0
        ranks = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self._rank = torch.distributed.get_rank() if ranks else 0
        self._stops = stops and not ranks  # in one process the run stops after the last traced step; ranks train on
        self._weights_at_first_forward = not ranks  # no collective may run inside one rank's forward
        self.trace: StepTrace | None = None  # the step being traced, while its window is open
        self.traces: list[StepTrace] = []
        self._closed = False  # the optimizer has read the step's gradients: nothing more is recorded
        self._calls: dict[str, int] = {}  # each module's calls in the step so far
        self._stack: dict[str, list[ModuleCall]] = {}  # each module's calls entered and not yet left
        self._arrived: set[tuple[str, int]] = set()  # the calls an input gradient has reached
        self._recomputed: dict[str, int] = {}  # each module's calls made again inside backward (checkpointing)
        self._last_pass: dict[str, int] = {}  # the backward pass (graph task) that last delivered to each parameter

    def __enter__(self) -> StepTracer:
        self._exits = contextlib.ExitStack()
        hooks = step_hooks(self._optimizer, self._before_step, self._after_step)
        if self._hooks_calls:
            hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._unhooked))
        hooks += [parameter.register_hook(self._delivered(name)) for name, parameter in self._parameters
                  if parameter.requires_grad]
        # a DTensor parameter's gradient as its collectives leave it (FSDP2 calls these after its reduce-scatter)
        hooks += [parameter.register_post_accumulate_grad_hook(self._reduced(name))
                  for name, parameter in self._parameters if parameter.requires_grad and is_dtensor(parameter)]
        for hook in hooks:
            self._exits.callback(hook.remove)
        self._follow()
        self._exits.enter_context(_loss_scale_seen(self))
        if 0 in self._steps:
            self._open_window()
        return self

    def __exit__(self, *exc: object) -> None:
        self._exits.close()

    def _follow(self) -> None:
        """The model read again: each module it holds now named by its place, and hooked if it was not yet. A module
        the step swapped in is then recorded where the reference's module at its place is."""
        if not self._hooks_calls:
            return
        self._strangers.clear()
        for name, module in self._modules():
            if id(module) not in self._names:
                self._hooked.append(module)
                # first, before a parallel plan's own input hooks: the gradient caught at an input is the one the
                # module sends back to its caller, after any collective those hooks put on the way back
                self._exits.callback(module.register_forward_pre_hook(self._entering, with_kwargs=True,
                                                                      prepend=True).remove)
                self._exits.callback(module.register_forward_hook(self._leaving, with_kwargs=True).remove)
            self._names[id(module)] = name

    def _unhooked(self, module: nn.Module, args: tuple) -> tuple | None:
        """Any module's call while a step is traced (torch's global hook): one the model holds now that was not
        hooked yet (swapped in inside the model's forward) is hooked, and this call recorded. Its keyword arguments
        are not seen here: they are from its next call on."""
        key = id(module)
        if not self._open or key in self._names or key in self._strangers or torch.compiler.is_compiling():
            return None
        self._follow()
        if key not in self._names:
            self._strangers[key] = module  # not the model's (a loss module, a wrapper around the model)
            return None
        entered = self._entering(module, args, {})
        return None if entered is None else entered[0]

    @property
    def _open(self) -> bool:
        return self.trace is not None and not self._closed

    def _open_window(self) -> None:
        """A traced step begins: recorded from now; its weights and the optimizer's state read now on ranks (their
        buffers again as the first forward starts), else as its first forward starts (whatever the code does after
        the previous ``optimizer.step()`` is part of what the step starts from)."""
        self.trace = StepTrace(self._steps_taken + self._offset, self._rank, [], [], {}, {}, {}, [])
        self._closed, self._calls, self._stack, self._arrived, self._recomputed = False, {}, {}, set(), {}
        self._last_pass = {}
        if not self._weights_at_first_forward:
            self._read_state()

    def _read_state(self) -> None:
        self.trace.weights_before = self._whole_weights()
        self._read_buffers()
        names = {id(p): name for name, p in self._parameters}
        held = self._regime.local_optimizer(self._optimizer)  # a sharded optimizer's own part holds this rank's state
        self.trace.optimizer_state = {
            f"{names[id(p)]}/{key}": _local(value) for group in held.param_groups for p in group["params"]
            if id(p) in names for key, value in held.state.get(p, {}).items()
            if isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())}

    def _read_buffers(self) -> None:
        """Every buffer as the model holds it now (a rank's own: no collective)."""
        self.trace.buffers_before = {
            f"{name}.{own}" if name else own: buffer.detach().to("cpu", copy=True)
            for name, module in self._modules() for own, buffer in module.named_buffers(recurse=False)
            if buffer is not None and (buffer.is_floating_point() or buffer.is_complex()) and not is_dtensor(buffer)}

    def _whole_weights(self) -> dict[str, Tensor]:
        """The weights whole (the regime's read-back, left out of the counts), as plain CPU copies."""
        with uncounted(), torch.no_grad():
            whole = self._regime.read_back({n: p.detach() for n, p in self._parameters})
        return {name: tensor.to("cpu", copy=True) for name, tensor in whole.items()}

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        trace = self.trace
        if not self._open or not (trace.root_inputs or trace.delivered  # no forward, no backward, no gradient set
                                  or any(p.grad is not None for _, p in self._parameters)):  # by hand (torch.func)
            return
        self._closed = True
        trace.read = {name: _local(p.grad) for name, p in self._parameters if p.grad is not None}
        trace.placed = {name: where for name, p in self._parameters if p.grad is not None
                        and (where := _placement(p.grad)) is not None}
        trace.hyper = numeric_settings(optimizer.param_groups)

    def _after_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        self._steps_taken += 1
        trace = self.trace
        if trace is not None:
            self.trace = None
            # calls no gradient reached an input of (token ids, data): they finish backward last, latest first
            trace.backward_order += [(c.module, c.index) for c in reversed(trace.calls)
                                     if (c.module, c.index) not in self._arrived]
            self.traces.append(trace)
            if self._stops and self._steps_taken > max(self._steps):
                raise TraceComplete
        if self._steps_taken in self._steps:
            self._open_window()

    def _entering(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """A module's forward pre-hook: its call recorded under the place it holds (the model read again at each
        call of its root), its inputs seen through views whose gradients are the call's."""
        if not self._open or _inferring_shapes():
            return None
        name = self._names[id(module)]
        if name == "":
            self._follow()
        try:
            leaves, spec = tree_flatten((args, kwargs))
            original = self._recomputing(name)
            if original is not None:  # its forward run again inside backward: its gradients are the call's
                return self._hooked_inputs(original, leaves, spec, id(module), record=False)
            index = self._calls.get(name, 0)
            self._calls[name] = index + 1
            call = ModuleCall(name, index, [], [])
            if not self.trace.root_inputs:  # the first call of the step: what this rank was fed
                self.trace.root_inputs = [_local(t) for t in leaves if isinstance(t, Tensor)]
                if self._weights_at_first_forward:
                    self._read_state()
                else:  # on ranks the buffers again: what the team's code did before its forward is part of the step
                    self._read_buffers()
            return self._hooked_inputs(call, leaves, spec, id(module), record=True)
        except Exception as error:  # a record missing is said, never a training stopped
            self._broken(name, error)
            return None

    def _recomputing(self, name: str) -> ModuleCall | None:
        """The call of ``name`` that a call made inside backward runs again (activation checkpointing recomputes each
        forward it left unsaved, in order), where one is left to stand for: its gradients flow through the
        recomputation, and belong to the forward the loss was computed from. None outside backward."""
        if torch._C._current_graph_task_id() == -1:
            return None
        done = self._recomputed.get(name, 0)
        calls = [call for call in self.trace.calls if call.module == name]
        if done >= len(calls):
            return None
        self._recomputed[name] = done + 1
        return calls[done]

    def _hooked_inputs(self, call: ModuleCall, leaves: list, spec, key: int, record: bool):
        """The call's inputs, each floating one that needs a gradient seen through an identity view whose gradient is
        the call's; recorded (``record``) for a call made now, not for a forward run again inside backward."""
        position = 0
        for leaf_index, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                continue
            if not (leaf.is_floating_point() or leaf.is_complex()):
                if record:
                    call.integers.append(_local(leaf))
                continue
            if record:
                call.inputs.append(_local(leaf))
                call.grad_inputs.append(None)
            if leaf.requires_grad and not is_dtensor(leaf) and position < len(call.grad_inputs):
                seen = leaf.view_as(leaf)
                seen.register_hook(self._grad_input(self.trace, call, position))
                leaves[leaf_index] = seen
            position += 1
        self._stack.setdefault(key, []).append((call, record, _random_state(leaves) if record else None))
        return tree_unflatten(leaves, spec)

    def _leaving(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """A module's forward hook: the outputs of the call its pre-hook recorded, seen with their gradients."""
        stack = self._stack.get(id(module))
        if not self._open or not stack:
            return
        call, record, random_state = stack.pop()
        try:
            after = None if random_state is None else _random_state(tree_flatten((args, kwargs))[0])
            if after is not None and not torch.equal(random_state, after):
                call.random_state = random_state  # it drew from the generator
            position = 0
            for leaf in tree_flatten(output)[0]:
                if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                    if record:
                        call.computed_in = call.computed_in or str(leaf.dtype)
                        call.outputs.append(_local(leaf))
                        call.grad_outputs.append(None)
                    if leaf.requires_grad and position < len(call.grad_outputs):
                        leaf.register_hook(self._grad_output(call, position))
                    position += 1
            if record:
                self.trace.calls.append(call)
        except Exception as error:
            self._broken(call.module, error)

    def _grad_input(self, trace: StepTrace, call: ModuleCall, position: int):
        arrived = self._arrived

        def hook(grad: Tensor) -> None:
            call.grad_inputs[position] = _added(call.grad_inputs[position], grad)
            key = (call.module, call.index)
            if key not in arrived:
                arrived.add(key)
                trace.backward_order.append(key)
        return hook

    def _grad_output(self, call: ModuleCall, position: int):
        def hook(grad: Tensor) -> None:
            call.grad_outputs[position] = _added(call.grad_outputs[position], grad)
        return hook

    def _delivered(self, name: str):
        def hook(grad: Tensor) -> None:
            if not self._open:
                return
            trace, task = self.trace, torch._C._current_graph_task_id()
            trace.delivered[name] = _added(trace.delivered.get(name), grad)
            if self._last_pass.get(name) != task:  # a pass that had not reached it yet
                self._last_pass[name] = task
                trace.last_pass.pop(name, None)
            trace.last_pass[name] = _added(trace.last_pass.get(name), grad)
        return hook

    def _reduced(self, name: str):
        last: dict[str, object] = {}  # the gradient tensor seen last, and what it held then

        def hook(parameter: Tensor) -> None:
            if not self._open or parameter.grad is None:
                return
            held = _local(parameter.grad)
            same = last.get("grad") is parameter.grad and last.get("trace") is self.trace
            added = held - last["held"] if same else held  # accumulated in place: what this reduction added
            last.update(grad=parameter.grad, held=held, trace=self.trace)
            self.trace.reduced[name] = _added(self.trace.reduced.get(name), added)
        return hook

    def _broken(self, name: str, error: Exception) -> None:
        if self.trace is not None and not self.trace.broken:
            self.trace.broken = f"module {name!r}: {type(error).__name__}: {error}"


@contextlib.contextmanager
def _loss_scale_seen(tracer: StepTracer) -> Iterator[None]:
    """While tracing: the scale a GradScaler (the harness's or one the code made) multiplies a loss by, noted on the
    step's trace, which divides it out of the activation gradients and what backward delivered."""
    from torch.amp import GradScaler

    plain = GradScaler.scale

    def scale(scaler, outputs):
        scaled = plain(scaler, outputs)
        trace = tracer.trace
        if trace is not None and scaler.is_enabled() and scaler._scale is not None and trace.loss_scale == 1.0:
            trace.loss_scale = float(scaler._scale)
        return scaled

    GradScaler.scale = scale
    try:
        yield
    finally:
        GradScaler.scale = plain


# The methods with which torch's pipeline stages run their module once, on stand-in tensors, to learn the shapes
# their neighbours send (the name changed across torch releases): no call of the training
_SHAPE_INFERENCE = frozenset({"_shape_inference", "_forward_metadata_inference", "_backward_metadata_inference"})


def _inferring_shapes() -> bool:
    """Whether this call is a pipeline stage's shape inference, not a forward the step trains on."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _SHAPE_INFERENCE and code.co_filename.endswith(os.path.join("pipelining", "stage.py")):
            return True
        frame = frame.f_back
    return False


def numeric_settings(groups: list[dict]) -> list[dict[str, float]]:
    """Each parameter group's numeric settings (its learning rate, betas' neighbours, weight decay), as floats."""
    return [{key: float(value) for key, value in group.items()
             if isinstance(value, (int, float)) and not isinstance(value, bool)} for group in groups]


def _random_state(leaves: list) -> Tensor | None:
    """The state of the random generator a call's tensors draw from (their device's; the CPU's where they have
    none), as a CPU tensor."""
    device = next((leaf.device for leaf in leaves if isinstance(leaf, Tensor)), torch.device("cpu"))
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state() if device.type == "cpu" else None


def _placement(tensor: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where this rank's part of a DTensor lies in the whole: (the whole's shape, the part's offset); None for a
    plain tensor, or a part that is no slice of the whole (a partial sum still to be reduced)."""
    if not is_dtensor(tensor) or any(placement.is_partial() for placement in tensor.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # DTensor's own arithmetic

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(tensor.shape), tuple(offset)


def _local(tensor: Tensor) -> Tensor:
    """A plain CPU copy of what this rank holds of ``tensor`` (a DTensor's local part; a sparse one densified; a
    bfloat16 one in float32, exactly, as numpy carries it from a rank)."""
    if is_dtensor(tensor):
        tensor = tensor.to_local()
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    return tensor.to("cpu", torch.float32 if tensor.dtype == torch.bfloat16 else None, copy=True)


def _added(total: Tensor | None, grad: Tensor) -> Tensor:
    """``total`` plus ``grad`` as a plain CPU tensor: every backward pass that reaches a record adds to it."""
    grad = _local(grad)
    return grad if total is None else total + grad


def traced(tracer: StepTracer | None) -> tuple[StepTrace, ...]:
    """The traces a run took, one per traced step."""
    return () if tracer is None else tuple(tracer.traces)
