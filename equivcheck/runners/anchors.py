"""Each step judged from the reference's own state: a lower-precision check that compounding rounding cannot fool.

A float32 run that is the reference's maths still parts from it after a few steps: where a gradient is at rounding
level (an attention key bias, whose true gradient is zero), an adaptive optimizer turns a difference below any
tolerance into an update of its learning rate's size, and every later step starts from other weights. Trained free,
the two runs then differ for no fault of the regime, and telling that apart took float64 shadows: two more trainings,
one at twice the memory.

Anchored, no step inherits another's rounding. The reference saves, as each step's first forward begins, what that
step starts from (each parameter's weight and optimizer state apart, the buffers and the optimizer's settings), in
the run's own dtype. The candidate loads the same as its own step begins, so that:

- each step's loss and gradients are compared with the reference's from the same state (the recorder does that);
- right after its optimizer's step, each parameter's new weight and optimizer state are compared with what the
  reference's own step left (the next step's start); one that is not within tolerance of it, with what the
  reference's optimizer makes, from the state the step began with, of the gradient the candidate read: what the
  candidate's optimizer did with it (its settings, its state, a step more). The first reads what the reference
  saved; the second runs the reference's optimizer again, for the parameters that need it alone (a matrix
  optimizer's Newton-Schulz costs as much as a training's step);
- what it carries into the next step must be what its optimizer left: a weight or a state written after the step
  (a decay of its own, moments cleared) leaves no anchored verdict; its settings (a schedule's learning rate) and its
  buffers (running statistics) are compared with the reference's.

Where the step starts and the reference's recording are kept follows the device. On the CPU, files (:class:`_Files`,
:class:`OnDisk`): the process holds no copy of the model's state, each parameter's file is read back a block of rows
at a time through a mapping of it (:data:`BLOCK_BYTES`), and an elementwise optimizer's update is computed a block at
a time as well, so a large embedding's weight and moments are never whole in memory beside the training. On a GPU
with room for them (:func:`held_on`), the device's own memory (:class:`_Held`): every comparison is made there, and
nothing crosses to the host.

A fault shows at the step where it acts. A run that cannot be judged so (a first step that begins from other
weights, a step whose forward no hook saw begin, more steps than the reference took, state written between steps) is
judged free-running instead (:attr:`Anchoring.void`, check.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..device import free_bytes
from ..diff import Measurement, TensorDiff
from ..regimes.base import step_hooks
from .tracing import numeric_settings

# What a block of one tensor's rows may hold: a parameter is read back, restored and updated a block at a time.
BLOCK_BYTES = 4 << 20
# Optimizers whose update of each element reads that element alone (and scalars): updated a block of rows at a time,
# they compute what they compute whole. Their exact types: a subclass may update otherwise.
ELEMENTWISE = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
    if hasattr(torch.optim, name))


def held_on(device: torch.device, parameters: list[tuple[str, Tensor]], steps: int) -> bool:
    """Whether a reference on ``device`` keeps its step starts and its recording in the device's memory: a GPU with
    room for them twice over (each step's weights and two moments and what the last step left, each step's gradients
    and the final weights).
    Never the CPU, where files keep the process's memory down."""
    free = free_bytes(device)
    weights = sum(p.numel() * p.element_size() for _, p in parameters)
    return free is not None and 2 * weights * (3 * (steps + 1) + steps + 1) <= free


class _Block(NamedTuple):
    """Rows of one parameter's saved start, fresh copies on the devices they were saved from: the weight's, and its
    optimizer state's (``sliced``: the state tensors shaped like the weight, cut to the same rows; the rest whole)."""

    weight: Tensor
    state: dict
    sliced: frozenset


def _cut(saved: dict, rows) -> _Block:
    weight = saved["weight"]
    sliced = frozenset(key for key, value in saved["state"].items()
                       if isinstance(value, Tensor) and weight.dim() and value.shape == weight.shape)
    devices = saved["devices"]

    def fresh(key: str, value):
        if not isinstance(value, Tensor):
            return value
        return (value[rows] if key in sliced else value).to(devices[key], copy=True)

    return _Block(weight[rows].to(devices["weight"], copy=True),
                  {key: fresh(key, value) for key, value in saved["state"].items()}, sliced)


def _start_of(parameter: Tensor, state: dict, copied) -> dict:
    """What one parameter's step starts from, as a store keeps it (``copied``: each tensor as it is kept)."""
    return {"weight": copied(parameter.detach()),
            "state": {key: copied(value) if isinstance(value, Tensor) else value for key, value in state.items()},
            "devices": {"weight": str(parameter.device),
                        **{key: str(value.device) for key, value in state.items() if isinstance(value, Tensor)}}}


class _Files:
    """Step starts on disk, one file a parameter: each read back a block of rows at a time through a mapping of its
    file, the mapping closed with the block (its pages leave the process's memory)."""

    def __init__(self, folder: str) -> None:
        self._folder = folder

    def _path(self, step: int, name: str) -> str:
        return os.path.join(self._folder, f"step-{step}", name)

    def has(self, step: int) -> bool:
        return os.path.isdir(os.path.dirname(self._path(step, "")))

    def save(self, step: int, common: dict, parameters: list[Tensor], optimizer: Optimizer) -> None:
        os.makedirs(os.path.dirname(self._path(step, "")), exist_ok=True)  # a run trained again saves again
        with _without_checksums():
            torch.save(common, self._path(step, "common.pt"))
            for index, parameter in enumerate(parameters):
                torch.save(_start_of(parameter, optimizer.state.get(parameter, {}), lambda t: t),
                           self._path(step, f"{index}.pt"))

    def common(self, step: int) -> dict:
        return torch.load(self._path(step, "common.pt"), weights_only=True)

    def block(self, step: int, index: int, rows) -> _Block:
        return _cut(torch.load(self._path(step, f"{index}.pt"), mmap=True, map_location="cpu", weights_only=True),
                    rows)


class _Held:
    """Step starts in the memory of the device the reference trained on (:func:`held_on`), read as copies."""

    def __init__(self) -> None:
        self._steps: dict[int, tuple[dict, list[dict]]] = {}

    def has(self, step: int) -> bool:
        return step in self._steps

    def save(self, step: int, common: dict, parameters: list[Tensor], optimizer: Optimizer) -> None:
        self._steps[step] = (copy.deepcopy(common), [_start_of(p, optimizer.state.get(p, {}), Tensor.clone)
                                                     for p in parameters])

    def common(self, step: int) -> dict:
        return copy.deepcopy(self._steps[step][0])  # a run's schedule may write to a tensor setting in place

    def block(self, step: int, index: int, rows) -> _Block:
        return _cut(self._steps[step][1][index], rows)


# The step starts held in device memory in this process, by the name of the check's anchors; one check's at a time.
_HELD: dict[str, _Held] = {}


def release(folder: str) -> None:
    """The check whose anchors are named ``folder`` is over: what it held in device memory is let go."""
    _HELD.pop(folder, None)


def _store(folder: str) -> _Files | _Held:
    return _HELD.get(folder) or _Files(folder)


class OnDisk(Mapping):
    """Named tensors written to files, each read back (mapped) as it is asked for, and let go with it: an anchored
    check's reference off a GPU keeps its recording (each step's gradients, the final weights) out of the process's
    memory, which then holds the training alone (runners/train.py)."""

    def __init__(self, folder: str, tensors: Mapping[str, Tensor]) -> None:
        os.makedirs(folder, exist_ok=True)  # a run trained again writes again
        self._folder, self._index = folder, {name: index for index, name in enumerate(tensors)}
        with _without_checksums():
            for index, tensor in enumerate(tensors.values()):
                torch.save(tensor.detach(), self._path(index))

    def _path(self, index: int) -> str:
        return os.path.join(self._folder, f"{index}.pt")

    def __getitem__(self, name: str) -> Tensor:
        return torch.load(self._path(self._index[name]), mmap=True, weights_only=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _rows(tensor: Tensor) -> list:
    """Blocks of ``tensor``'s rows of at most :data:`BLOCK_BYTES` (a row more where one row is larger): the whole
    tensor (``...``) where it is no larger, or has no rows."""
    if tensor.dim() == 0 or tensor.numel() * tensor.element_size() <= BLOCK_BYTES or len(tensor) < 2:
        return [...]
    per_block = max(1, BLOCK_BYTES * len(tensor) // (tensor.numel() * tensor.element_size()))
    return [slice(start, start + per_block) for start in range(0, len(tensor), per_block)]


def _first_element(tensor: Tensor, rows) -> int:
    return 0 if rows is ... else rows.start * math.prod(tensor.shape[1:])


class _StepStarts:
    """Calls ``begin(step)`` as each optimizer step's first forward begins (a step's micro-batches and recomputed
    forwards after the first call nothing), ``reading()`` as each optimizer step begins (after the recorder has read
    its gradients) and ``stepped(step)`` right after it."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, begin, stepped=None, reading=None) -> None:
        self._model, self._optimizer, self._begin, self._stepped = model, optimizer, begin, stepped
        self._reading = reading
        self.steps_taken, self._begun = 0, -1

    def __enter__(self) -> _StepStarts:
        reading = None if self._reading is None else (lambda *args: self._reading())
        self._handles = [self._model.register_forward_pre_hook(self._forward, prepend=True),
                         *step_hooks(self._optimizer, reading, self._after_step)]
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
           optimizer: Optimizer, held: bool) -> Iterator[None]:
    """While the reference trains: the state each step starts from, saved as the step's first forward begins (and
    what its last step left, once it has trained), one parameter's weight and optimizer state apart from another's:
    in its device's memory where ``held`` (:func:`held_on`), else to files in ``folder``."""
    if held:
        _HELD.clear()  # one check's at a time: a check abandoned midway holds nothing once another begins
        store = _HELD[folder] = _Held()
    else:
        store = _Files(folder)

    def save(step: int) -> None:
        store.save(step, {"buffers": {name: b.detach() for name, b in buffers},
                          "param_groups": optimizer.state_dict()["param_groups"]}, [p for _, p in parameters], optimizer)

    with _StepStarts(model, optimizer, save) as starts:
        yield
    save(starts.steps_taken)  # what the last step left: the candidate's last update is compared with it first


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
        self._store, self._parameters, self._buffers = _store(folder), parameters, buffers
        self._model, self._optimizer, self._measurement, self._steps = model, optimizer, measurement, steps
        self._loaded = -1  # the step whose anchor the run started from
        self._left: list[tuple[int, tuple]] = []  # what its last step left: each weight's and state's versions
        self._read: list[tuple[int, int] | None] = []  # each gradient as the step began: its identity and version
        self._groups: list[dict] = []  # the reference's optimizer settings for the step begun, group by group
        self.compared_final = False  # the last update was compared: it stands for the final weights
        self.void = ""  # why the run was not judged anchored, where it was not

    def __enter__(self) -> Anchoring:
        self._starts = _StepStarts(self._model, self._optimizer, self._begin, self._stepped,
                                   self._read_gradients).__enter__()
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
        if step >= self._steps or not self._store.has(step):
            self.void = f"it began step {step}, which the reference never began"
            return
        common = self._store.common(step)
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
            self.void = self._restore(step, index, name, parameter)
            if self.void:
                return
        self._loaded = step

    def _restore(self, step: int, index: int, name: str, parameter: Tensor) -> str:
        """One parameter's weight and optimizer state set to the reference's as ``step`` began, a block of rows at a
        time; at the first step, why the run began elsewhere, where it did."""
        state: dict = {}
        for rows in _rows(parameter):
            block = self._store.block(step, index, rows)
            elsewhere = "" if step else self._began_elsewhere(name, parameter[rows], block.weight)
            if elsewhere:
                return elsewhere
            parameter[rows].copy_(block.weight)
            for key, value in block.state.items():
                if key in block.sliced and rows is not ...:
                    if key not in state:
                        state[key] = value.new_empty(parameter.shape)
                    state[key][rows].copy_(value)
                else:
                    state[key] = value
        if state:
            self._optimizer.state[parameter] = state
        else:
            self._optimizer.state.pop(parameter, None)
        return ""

    @staticmethod
    def _began_elsewhere(name: str, rows: Tensor, reference: Tensor) -> str:
        """Why the run's first step is no anchored one: rows of a weight it begins from are not the reference's (both
        are drawn from one seed, so they are equal to the bit); "" where they are."""
        return "" if torch.equal(rows, reference) else f"its weight {name!r} began elsewhere than the reference's"

    def _stepped(self, step: int) -> None:
        """Right after the optimizer's step: each parameter's new weight and state against the reference's
        optimizer's update, from the state the step began with, of the gradient this run's optimizer read."""
        if self.void:
            return
        if self._loaded != step:
            self.void = f"step {step} began from no anchor (its forward unseen)"
            return
        if self._gradient_versions() != self._read:  # its update is then of other gradients than those compared
            self.void = f"a gradient was written after step {step} began, once the recorder had compared it"
            return
        group_of = {id(p): index for index, group in enumerate(self._optimizer.param_groups) for p in group["params"]}
        last = step == self._steps - 1
        for index, (name, parameter) in enumerate(self._parameters):
            self._compare_update(step, index, name, parameter, self._groups[group_of[id(parameter)]], last)
        self.compared_final = last
        self._left = [(id(p), _versions(p, self._optimizer.state.get(p, {}))) for _, p in self._parameters]

    def _compare_update(self, step: int, index: int, name: str, parameter: Tensor, settings: dict,
                        last: bool) -> None:
        """One parameter's new weight (the final one after the ``last`` step) and state against what the reference's
        own step left (:meth:`_followed`), else against the reference's optimizer's update of the run's gradient
        (:meth:`_recomputed`)."""
        diffs, shapes = self._followed(step, index, name, parameter) or self._recomputed(step, index, name, parameter,
                                                                                         settings)
        for (kind, quantity), joined in diffs.items():
            self._measurement.add_diff(kind, None if last and kind == "weight" else step, quantity,
                                       TensorDiff.joined(joined, shapes[(kind, quantity)]))

    def _followed(self, step: int, index: int, name: str, parameter: Tensor) -> tuple | None:
        """The parameter's new weight and state against what the reference's own step left, a block of rows at a
        time, whatever its optimizer: their parts where every one is within tolerance of it, else None. Nothing is
        computed again: a matrix optimizer's Newton-Schulz costs as much as a training's step."""
        if not self._store.has(step + 1):
            return None
        return self._parts(step, name, parameter, _rows(parameter),
                           lambda rows: self._store.block(step + 1, index, rows), strict=True)

    def _recomputed(self, step: int, index: int, name: str, parameter: Tensor, settings: dict) -> tuple:
        """The parameter's new weight and state against the reference's optimizer's update, from the state ``step``
        began with, of the gradient the run read (a gradient within tolerance that an adaptive optimizer turns into
        another update): a block of rows at a time for an elementwise optimizer (:data:`ELEMENTWISE`), whole for
        another (the update of a block of a matrix is another)."""
        grad = parameter.grad
        blockwise = type(self._optimizer) in ELEMENTWISE and (grad is None or grad.layout == torch.strided)
        return self._parts(step, name, parameter, _rows(parameter) if blockwise else [...],
                           lambda rows: self._updated(step, index, rows, grad, settings), strict=False)

    def _updated(self, step: int, index: int, rows, grad: Tensor | None, settings: dict) -> _Block:
        """Rows of one parameter as the reference's optimizer steps them, from the state ``step`` began with, by the
        run's gradient ``grad``."""
        block = self._store.block(step, index, rows)
        weight = nn.Parameter(block.weight)  # the reference's optimizer steps it in place
        reference = _alike(self._optimizer, {**settings, "params": [weight]})
        if block.state:
            reference.state[weight] = block.state
        weight.grad = None if grad is None else grad[rows]
        if weight.grad is not None:
            reference.step()
        state = reference.state.get(weight, {})
        return _Block(weight.detach(), state, frozenset(key for key, value in _state(state).items()
                                                        if value.shape == weight.shape))

    def _parts(self, step: int, name: str, parameter: Tensor, blocks: list, expected_at,
               strict: bool) -> tuple | None:
        """The parameter's weight and floating state against ``expected_at(rows)`` (a :class:`_Block`), block by
        block: each quantity's differences and shape. ``strict``: None where any part is not within tolerance or
        cannot be compared part by part, nothing measured; else such a part is measured whole, which notes it."""
        state = self._optimizer.state.get(parameter, {})
        parts: dict[tuple[str, str], list[tuple[int, TensorDiff]]] = {}
        shapes: dict[tuple[str, str], torch.Size] = {}
        for number, rows in enumerate(blocks):
            expected = expected_at(rows)
            pairs = [(("weight", name), parameter, expected.weight, True)]
            pairs += [(("optimizer", f"{name}/{key}"), state.get(key), value, key in expected.sliced)
                      for key, value in _state(expected.state).items()]  # shaped like the weight: cut to the rows
            for (kind, quantity), actual, wanted, sliced in pairs:
                if not sliced and number:  # a tensor not cut to the rows is compared at the first block
                    continue
                cut_to = rows if sliced else ...
                cut = None if actual is None or (cut_to is not ... and not actual.dim()) else actual[cut_to]
                if cut is None or cut.shape != wanted.shape or (kind, quantity) in self._measurement.broken:
                    if strict:
                        return None
                    self._measurement.add(kind, step, {} if actual is None else {quantity: actual}, {quantity: wanted})
                    continue
                diff = TensorDiff.of(cut.reshape(-1), wanted.reshape(-1), self._measurement.tolerance)
                if strict and diff.mismatched:
                    return None
                shapes[(kind, quantity)] = actual.shape
                parts.setdefault((kind, quantity), []).append((_first_element(actual, cut_to), diff))
        return parts, shapes

    def _compare_buffers(self, step: int, reference: dict[str, Tensor]) -> None:
        """What the forwards of ``step`` left in the run's buffers (running statistics) against the reference's, before
        the reference's replace them."""
        self._measurement.add("buffer", step, {name: b.detach() for name, b in self._buffers}, reference)

    def _read_gradients(self) -> None:
        """As the optimizer's step begins, right after the recorder compared the gradients: which they are."""
        self._read = self._gradient_versions()

    def _gradient_versions(self) -> list[tuple[int, int] | None]:
        return [None if p.grad is None else (id(p.grad), p.grad._version) for _, p in self._parameters]

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


def _alike(optimizer: Optimizer, group: dict) -> Optimizer:
    """An optimizer of ``optimizer``'s class over the one ``group``, with no state and no step hooks: built by its
    class from the group where its constructor takes param groups first, as torch's do; otherwise (a team's, whose
    constructor takes its own arguments: Muon's matrices apart from AdamW's rest) ``optimizer``'s attributes given
    the group alone, so that its ``step`` is the same code over the same settings."""
    try:
        return type(optimizer)([group])
    except TypeError:
        alike = object.__new__(type(optimizer))
    alike.__dict__.update(optimizer.__dict__)  # copy.copy would keep torch's three alone (Optimizer.__getstate__)
    alike.param_groups, alike.state = [group], defaultdict(dict)
    alike._optimizer_step_pre_hooks, alike._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    return alike


def _state(state: dict) -> dict[str, Tensor]:
    """A parameter's optimizer state, the floating tensors: those an update computes."""
    return {key: value for key, value in state.items() if isinstance(value, Tensor) and value.is_floating_point()}


def _versions(parameter: Tensor, state: dict) -> tuple:
    """What identifies a weight's and its state's contents as they are now: each tensor's identity and version (an
    in-place write bumps it)."""
    return (parameter._version,) + tuple((key, id(value), value._version) for key, value in sorted(state.items())
                                         if isinstance(value, Tensor))
