"""Each step judged from the reference's own state: a lower-precision check that compounding rounding cannot fool.

A float32 run that is the reference's maths still parts from it after a few steps: where a gradient is at rounding
level (an attention key bias, whose true gradient is zero), an adaptive optimizer turns a difference below any
tolerance into an update of its learning rate's size, and every later step starts from other weights. Trained free,
the two runs then differ for no fault of the regime, and telling that apart took float64 shadows: two more trainings,
one at twice the memory.

Anchored, no step inherits another's rounding. The reference saves, as each step's first forward begins, what that
step starts from (each parameter's weight and optimizer state, one file each, the buffers and the optimizer's
settings), in the run's own dtype, to a folder on disk. The candidate loads the same as its own step begins, so that:

- each step's loss and gradients are compared with the reference's from the same state (the recorder does that);
- right after its optimizer's step, each parameter's new weight and optimizer state are compared with what the
  reference's optimizer makes, from the state the step began with, of the gradient the candidate read: what the
  candidate's optimizer did with it (its settings, its state, a step more);
- what it carries into the next step must be what its optimizer left: a weight or a state written after the step
  (a decay of its own, moments cleared) leaves no anchored verdict; its settings (a schedule's learning rate) and its
  buffers (running statistics) are compared with the reference's.

One parameter's files are in memory at a time, beside the training: no copy of the model's state. A fault shows at
the step where it acts. A run that cannot be judged so (a first step that begins from other weights, a step whose
forward no hook saw begin, more steps than the reference took, state written between steps) is judged free-running
instead (:attr:`Anchoring.void`, check.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..diff import Measurement
from .tracing import numeric_settings


def _folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


class _StepStarts:
    """Calls ``begin(step)`` as each optimizer step's first forward begins (a step's micro-batches and recomputed
    forwards after the first call nothing), and ``stepped(step)`` right after each optimizer step."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, begin, stepped=None) -> None:
        self._model, self._optimizer, self._begin, self._stepped = model, optimizer, begin, stepped
        self.steps_taken, self._begun = 0, -1

    def __enter__(self) -> _StepStarts:
        self._handles = [self._model.register_forward_pre_hook(self._forward, prepend=True),
                         self._optimizer.register_step_post_hook(self._after_step)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _after_step(self, *args: object) -> None:
        if self._stepped is not None:
            with torch.no_grad():
                self._stepped(self.steps_taken)
        self.steps_taken += 1

    def _forward(self, *args: object) -> None:
        if self._begun < self.steps_taken:
            self._begun = self.steps_taken
            with torch.no_grad():
                self._begin(self.steps_taken)


@contextlib.contextmanager
def saving(folder: str, parameters: list[tuple[str, Tensor]], buffers: list[tuple[str, Tensor]], model: nn.Module,
           optimizer: Optimizer) -> Iterator[None]:
    """While the reference trains: the state each step starts from, saved to ``folder`` as the step's first forward
    begins, one file a parameter (its weight and its optimizer state)."""
    def save(step: int) -> None:
        where = _folder(folder, step)
        os.makedirs(where, exist_ok=True)  # a run trained again (run_request) saves again
        torch.save({"buffers": {name: b.detach() for name, b in buffers},
                    "param_groups": optimizer.state_dict()["param_groups"]}, os.path.join(where, "common.pt"))
        for index, (_, parameter) in enumerate(parameters):
            torch.save({"weight": parameter.detach(), "state": dict(optimizer.state.get(parameter, {}))},
                       os.path.join(where, f"{index}.pt"))

    with _StepStarts(model, optimizer, save), _without_checksums():
        yield


def _without_checksums() -> contextlib.AbstractContextManager:
    """torch.save without its zip records' CRC-32 (4.6 times faster here, measured on 256 MB): the files live for one
    check, read back by the process that wrote them or its child. Where the setting is unknown (an older torch),
    nothing changes."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})


class Anchoring:
    """The candidate's side: each step started from the reference's saved state, each update compared, parameter by
    parameter, with the reference's optimizer's update of the candidate's gradient, in ``measurement``; ``steps``:
    the reference's, whose last update stands for the final weights."""

    def __init__(self, folder: str, parameters: list[tuple[str, Tensor]], buffers: list[tuple[str, Tensor]],
                 model: nn.Module, optimizer: Optimizer, measurement: Measurement, steps: int) -> None:
        self._folder, self._parameters, self._buffers = folder, parameters, buffers
        self._model, self._optimizer, self._measurement, self._steps = model, optimizer, measurement, steps
        self._loaded = -1  # the step whose anchor the run started from
        self._left: list[tuple[int, tuple]] = []  # what its last step left: each weight's and state's versions
        self._groups: list[dict] = []  # the reference's optimizer settings for the step begun, group by group
        self.compared_final = False  # the last update was compared: it stands for the final weights
        self.void = ""  # why the run was not judged anchored, where it was not

    def __enter__(self) -> Anchoring:
        self._starts = _StepStarts(self._model, self._optimizer, self._begin, self._stepped).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._starts.__exit__(*exc)
        if self.void:
            self._measurement.unanchored = self.void

    def _begin(self, step: int) -> None:
        """The step's first forward: what the run carries checked, then the reference's state for this step loaded."""
        if self.void:
            return
        if step and self._written_since_the_step():
            self.void = f"its weights or its optimizer's state were written after step {step - 1}, outside the step"
            return
        where = _folder(self._folder, step)
        if not os.path.isdir(where):
            self.void = f"it began step {step}, which the reference never began"
            return
        common = torch.load(os.path.join(where, "common.pt"), weights_only=True)
        self._compare_settings(step, common["param_groups"])
        if step:
            self._compare_buffers(step - 1, common["buffers"])
        for name, buffer in self._buffers:
            buffer.copy_(common["buffers"][name])
        self._groups = [{key: value for key, value in settings.items() if key != "params"}
                        for settings in common["param_groups"]]
        for group, settings in zip(self._optimizer.param_groups, self._groups):
            group.update(settings)
        for index, (name, parameter) in enumerate(self._parameters):
            saved = torch.load(os.path.join(where, f"{index}.pt"), weights_only=True)
            self.void = "" if step else self._began_elsewhere(name, parameter, saved["weight"])
            if self.void:
                return
            parameter.copy_(saved["weight"])
            if saved["state"]:
                self._optimizer.state[parameter] = saved["state"]
            else:
                self._optimizer.state.pop(parameter, None)
        self._loaded = step

    def _stepped(self, step: int) -> None:
        """Right after the optimizer's step: each parameter's new weight and state against the reference's
        optimizer's update, from the state the step began with, of the gradient this run's optimizer read."""
        if self.void:
            return
        if self._loaded != step:
            self.void = f"step {step} began from no anchor (its forward unseen)"
            return
        where = _folder(self._folder, step)
        group_of = {id(p): index for index, group in enumerate(self._optimizer.param_groups) for p in group["params"]}
        last = step == self._steps - 1
        for index, (name, parameter) in enumerate(self._parameters):
            saved = torch.load(os.path.join(where, f"{index}.pt"), weights_only=True)
            weight = nn.Parameter(saved["weight"])  # the reference's optimizer steps it in place
            reference = type(self._optimizer)([{**self._groups[group_of[id(parameter)]], "params": [weight]}])
            if saved["state"]:
                reference.state[weight] = saved["state"]
            weight.grad = parameter.grad
            if weight.grad is not None:
                reference.step()
            self._measurement.add("weight", None if last else step, {name: parameter.detach()},
                                  {name: weight.detach()})
            self._measurement.add("optimizer", step, _state(name, self._optimizer.state.get(parameter, {})),
                                  _state(name, reference.state.get(weight, {})))
        self.compared_final = last
        self._left = [(id(p), _versions(p, self._optimizer.state.get(p, {}))) for _, p in self._parameters]

    def _compare_buffers(self, step: int, reference: dict[str, Tensor]) -> None:
        """What the forwards of ``step`` left in the run's buffers (running statistics) against the reference's, before
        the reference's replace them."""
        self._measurement.add("buffer", step, {name: b.detach() for name, b in self._buffers}, reference)

    @staticmethod
    def _began_elsewhere(name: str, parameter: Tensor, reference: Tensor) -> str:
        """Why the run's first step is no anchored one: a weight it begins from is not the reference's (both are drawn
        from one seed, so they are equal to the bit); "" where it is."""
        return "" if torch.equal(parameter, reference) else f"its weight {name!r} began elsewhere than the reference's"

    def _written_since_the_step(self) -> bool:
        """Whether a weight or an optimizer state was written (or replaced) after the last step took them."""
        held = {id(p): _versions(p, self._optimizer.state.get(p, {})) for _, p in self._parameters}
        return any(held.get(identity) != versions for identity, versions in self._left)

    def _compare_settings(self, step: int, reference: list[dict]) -> None:
        """The optimizer's numeric settings the run carries into ``step`` (a schedule's learning rate) against the
        reference's, before the reference's replace them."""
        def settings(groups: list[dict]) -> dict[str, Tensor]:
            return {f"group {index}/{key}": torch.tensor(value, dtype=torch.float64)
                    for index, group in enumerate(numeric_settings(groups)) for key, value in group.items()}
        self._measurement.add("optimizer", step, settings(self._optimizer.param_groups), settings(reference))


def _state(name: str, state: dict) -> dict[str, Tensor]:
    """A parameter's optimizer state as named tensors (``"fc.weight/exp_avg"``): the floating ones, which an update
    computes."""
    return {f"{name}/{key}": value for key, value in state.items()
            if isinstance(value, Tensor) and value.is_floating_point()}


def _versions(parameter: Tensor, state: dict) -> tuple:
    """What identifies a weight's and its state's contents as they are now: each tensor's identity and version (an
    in-place write bumps it)."""
    return (parameter._version,) + tuple((key, id(value), value._version) for key, value in sorted(state.items())
                                         if isinstance(value, Tensor))
