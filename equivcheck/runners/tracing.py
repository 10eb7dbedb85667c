"""Tracing one optimizer step at its module boundaries, for saying where a failed run parts from its reference.

A check that failed replays the first step that parts, in the reference and in the candidate, with this tracer on
(``RunRequest.trace_step``). It opens after the optimizer's previous step and closes at that step: every module
call in between is recorded (inputs, outputs, and through tensor hooks the gradients of each), with what backward
delivered to each parameter, the gradients the optimizer read, the weights and the optimizer's state it started
from. A run in one process then stops: its replay costs the steps up to the one that parts, never the whole training
again. Ranks train on to the end (a rank that stopped alone inside a join or a pipeline schedule would leave the others
waiting), and read the weights where they are in step with each other: at the optimizer's hooks.

Hooks observe and never change a value: an input is seen through ``view_as`` (an identity view, so that the
gradient this module alone sends to it can be caught), every record is a copy. A hook that cannot record a call
notes why in the trace and lets training go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..measure.collectives import uncounted
from ..process.torch_imports import is_dtensor
from ..regimes import Regime
from ..trace import ModuleCall, StepTrace


class TraceComplete(Exception):
    """The traced step is over: the run stops there (train.py reads the trace)."""


@contextlib.contextmanager
def tracing(model: nn.Module, optimizer: Optimizer, regime: Regime, step: int | None) -> Iterator[StepTracer | None]:
    """While training: ``step`` traced (None: nothing traced, nothing hooked)."""
    if step is None:
        yield None
        return
    tracer = StepTracer(model, optimizer, regime, step)
    with tracer:
        yield tracer


class StepTracer:
    """Records optimizer step ``step`` of a run on ``model`` (the case's model, as the regime trains it)."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, regime: Regime, step: int) -> None:
        from .train import case_named  # train.py enters the tracer: imported here, where it is used

        self._model, self._optimizer, self._regime, self.step = model, optimizer, regime, step
        self._modules = case_named(model.named_modules())
        self._parameters = case_named(model.named_parameters())
        self._steps_taken = 0
        self._open = False
        self._calls: dict[str, int] = {}
        self._stack: dict[str, list[ModuleCall]] = {}
        self._arrived: set[tuple[str, int]] = set()
        ranks = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self._stops = not ranks  # in one process the run stops after the traced step; ranks train on
        self._done = False
        self._weights_at_first_forward = not ranks  # no collective may run inside one rank's forward
        self.trace = StepTrace(step, torch.distributed.get_rank() if ranks else 0, [], [], {}, {}, {}, [])

    def __enter__(self) -> StepTracer:
        self._exits = contextlib.ExitStack()
        hooks = [self._optimizer.register_step_pre_hook(self._before_step),
                 self._optimizer.register_step_post_hook(self._after_step)]
        for name, module in self._modules:
            hooks.append(module.register_forward_pre_hook(self._entering(name), with_kwargs=True))
            hooks.append(module.register_forward_hook(self._leaving(name), with_kwargs=True))
        hooks += [parameter.register_hook(self._delivered(name)) for name, parameter in self._parameters
                  if parameter.requires_grad]
        for hook in hooks:
            self._exits.callback(hook.remove)
        self._exits.enter_context(_loss_scale_seen(self.trace))
        if self.step == 0:
            self._open_window()
        return self

    def __exit__(self, *exc: object) -> None:
        self._exits.close()

    def _open_window(self) -> None:
        """The step begins: recorded from now; its weights and the optimizer's state read now on ranks, else as its
        first forward starts (whatever the code does after the previous ``optimizer.step()`` is part of what the step
        starts from)."""
        self._open = True
        if not self._weights_at_first_forward:
            self._read_state()

    def _read_state(self) -> None:
        self.trace.weights_before = self._whole_weights()
        names = {id(p): name for name, p in self._parameters}
        self.trace.optimizer_state = {
            f"{names[id(p)]}/{key}": _local(value) for group in self._optimizer.param_groups for p in group["params"]
            if id(p) in names for key, value in self._optimizer.state.get(p, {}).items()
            if isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())}

    def _whole_weights(self) -> dict[str, Tensor]:
        from .train import snapshot

        with uncounted(), torch.no_grad():
            return snapshot(self._regime.read_back({n: p.detach() for n, p in self._parameters}).items())

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._open or not self.trace.root_inputs:  # a step with no forward in the window records nothing
            return
        self._open = False
        self.trace.read = {name: _local(p.grad) for name, p in self._parameters if p.grad is not None}
        self.trace.hyper = [{key: float(value) for key, value in group.items()
                             if isinstance(value, (int, float)) and not isinstance(value, bool)}
                            for group in optimizer.param_groups]

    def _after_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        self._steps_taken += 1
        if self._steps_taken == self.step:
            self._open_window()
        elif self._steps_taken == self.step + 1 and not self._done:
            self._done = True
            order = self.trace.backward_order
            # calls no gradient reached an input of (token ids, data): they finish backward last, latest first
            order += [(c.module, c.index) for c in reversed(self.trace.calls) if (c.module, c.index) not in self._arrived]
            if self._stops:
                raise TraceComplete

    def _entering(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if not self._open:
                return None
            try:
                index = self._calls.get(name, 0)
                self._calls[name] = index + 1
                leaves, spec = tree_flatten((args, kwargs))
                call = ModuleCall(name, index, [], [])
                if not self.trace.root_inputs:  # the first call of the step: what this rank was fed
                    self.trace.root_inputs = [_local(t) for t in leaves if isinstance(t, Tensor)]
                    if self._weights_at_first_forward:
                        self._read_state()
                for leaf_index, leaf in enumerate(leaves):
                    if not isinstance(leaf, Tensor):
                        continue
                    if not (leaf.is_floating_point() or leaf.is_complex()):
                        call.integers.append(_local(leaf))
                        continue
                    call.inputs.append(_local(leaf))
                    call.grad_inputs.append(None)
                    if leaf.requires_grad and not is_dtensor(leaf):
                        seen = leaf.view_as(leaf)
                        seen.register_hook(self._grad_input(call, len(call.inputs) - 1))
                        leaves[leaf_index] = seen
                self._stack.setdefault(name, []).append(call)
                return tree_unflatten(leaves, spec)
            except Exception as error:  # a record missing is said, never a training stopped
                self._broken(name, error)
                return None
        return hook

    def _leaving(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            stack = self._stack.get(name)
            if not self._open or not stack:
                return
            call = stack.pop()
            try:
                for leaf in tree_flatten(output)[0]:
                    if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                        call.outputs.append(_local(leaf))
                        call.grad_outputs.append(None)
                        if leaf.requires_grad:
                            leaf.register_hook(self._grad_output(call, len(call.outputs) - 1))
                self.trace.calls.append(call)
            except Exception as error:
                self._broken(name, error)
        return hook

    def _grad_input(self, call: ModuleCall, position: int):
        def hook(grad: Tensor) -> None:
            call.grad_inputs[position] = _added(call.grad_inputs[position], grad)
            key = (call.module, call.index)
            if key not in self._arrived:
                self._arrived.add(key)
                self.trace.backward_order.append(key)
        return hook

    def _grad_output(self, call: ModuleCall, position: int):
        def hook(grad: Tensor) -> None:
            call.grad_outputs[position] = _added(call.grad_outputs[position], grad)
        return hook

    def _delivered(self, name: str):
        def hook(grad: Tensor) -> None:
            if self._open:
                self.trace.delivered[name] = _added(self.trace.delivered.get(name), grad)
        return hook

    def _broken(self, name: str, error: Exception) -> None:
        if not self.trace.broken:
            self.trace.broken = f"module {name!r}: {type(error).__name__}: {error}"


@contextlib.contextmanager
def _loss_scale_seen(trace: StepTrace) -> Iterator[None]:
    """While tracing: the scale a GradScaler (the harness's or one the code made) multiplies a loss by, noted on the
    trace, which divides it out of the activation gradients and what backward delivered."""
    from torch.amp import GradScaler

    plain = GradScaler.scale

    def scale(scaler, outputs):
        scaled = plain(scaler, outputs)
        if scaler.is_enabled() and scaler._scale is not None and trace.loss_scale == 1.0:
            trace.loss_scale = float(scaler._scale)
        return scaled

    GradScaler.scale = scale
    try:
        yield
    finally:
        GradScaler.scale = plain


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
    """The trace a run took, where it took one."""
    return () if tracer is None else (dataclasses.replace(tracer.trace),)
