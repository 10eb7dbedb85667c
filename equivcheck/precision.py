"""Precision modes: the dtype a case trains in, the autocast around its forward, and the stated tolerance.

A run in one mode is compared only with the reference in the same mode, so each mode's tolerance
covers the reordering error of that mode (a micro-batch sums in another order than the global batch)
and nothing else. float64 and float32 use torch.testing's tolerances for their dtype. Autocast modes
keep float32 master weights and run matmuls and convolutions in a 16-bit type; their gradients are
sums of 16-bit products, so an element that cancels to near zero still carries the rounding of its
larger terms: the absolute tolerance is set at that scale (measured: see ``equivcheck catalogue``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .device import DEFAULT_DEVICE, DEVICES
from .device import missing as missing_device
from .errors import InvalidArgument, Unavailable, expect_tolerances
from .process.kernels import DEFAULT, KernelPath, decide, needs_probe, path_named


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a run computes: parameter dtype, autocast dtype (forward and loss only), GradScaler; numerics only; where
    a run trains is its device's (equivcheck.device), among the ``devices`` whose kernels this mode is defined on."""

    name: str
    dtype: torch.dtype
    rtol: float
    atol: float
    autocast: torch.dtype | None = None
    devices: tuple[str, ...] = DEVICES
    grad_scaler: bool = False
    description: str = ""
    # The dtype the model and data are drawn in, where it is not ``dtype``: torch draws other random
    # numbers in float64 than in float32, so a float64 shadow of a float32 run draws in float32.
    draw_dtype: torch.dtype | None = None
    # The kernel path a CPU autocast mode runs on in this process (kernels.py), once probed; None: not yet.
    kernels: str | None = None
    # The dtype the forward and backward compute in where the parameters are kept in ``dtype`` (master weights): each
    # module's own parameters and floating inputs cast to it as its forward begins, so its gradients come back to the
    # ``dtype`` parameters, are accumulated and stepped there (FSDP2's MixedPrecisionPolicy(param_dtype=...)).
    compute: torch.dtype | None = None
    # The dtype a shadow's weights and data are rounded to before its own (a float64 shadow of pure bf16 starts where
    # the bf16 run does: from the float32 draws rounded to bfloat16).
    rounded_to: torch.dtype | None = None

    @property
    def computes_in(self) -> torch.dtype:
        """The dtype the model's matmuls run in: autocast's, the compute copy's, or the parameters' own."""
        return self.autocast or self.compute or self.dtype

    @property
    def low(self) -> bool:
        """Whether the model computes in a 16-bit type (its kernels probed on the CPU, its zero gradients' noise as
        large as small real ones: witness.rounding_levels)."""
        return self.computes_in in (torch.bfloat16, torch.float16)

    @property
    def kernel_path(self) -> KernelPath:
        return path_named(self.kernels or DEFAULT.name)

    @property
    def default_device(self) -> str:
        """Where a run in this mode trains when the caller names no device: the CPU where the mode is defined there."""
        return DEFAULT_DEVICE if DEFAULT_DEVICE in self.devices else self.devices[0]

    def with_kernels(self, device: str) -> Precision:
        """This mode with its kernel path on ``device`` decided: probed in this process where it needs one
        (kernels.py). Raises :class:`Unavailable` when no path survives its probe."""
        if self.kernels is not None or not needs_probe(self, device):
            return self
        decision = decide(self)
        if decision.path is None:
            raise Unavailable(decision.note)
        return dataclasses.replace(self, kernels=decision.path.name)

    def unavailable(self, device: str) -> str | None:
        """Why this machine cannot run the mode on ``device`` (None when it can): never faked on other hardware."""
        if device not in self.devices:
            return f"precision {self.name!r} is defined on {' and '.join(self.devices)} only, not device={device!r}"
        missing = missing_device(device)
        return f"precision {self.name!r}: {missing}" if missing else None

    def prepare(self, model: nn.Module, device: torch.device | str) -> nn.Module:
        """Move ``model`` to this mode's dtype and device; wrap each module's forward in autocast, or on a compute copy
        of its parameters (``compute``).

        Autocast wraps the forward passes only, never backward or the optimizer step (as AMP asks),
        and every module's, so a regime that calls a part of the model (a trunk, a head) gets it too.
        A complex parameter or buffer goes to the complex dtype of this mode's width, never to a real one.
        """
        if any(t.is_complex() for t in itertools.chain(model.parameters(), model.buffers())):
            model = model._apply(functools.partial(_moved, device=device, dtype=self.dtype))
        else:  # through the model's own ``to``, which a model may extend (a LightningModule notes its dtype there)
            model = model.to(device=device, dtype=self.rounded_to or self.dtype)
            if self.rounded_to is not None:
                model = model.to(dtype=self.dtype)
        if self.autocast is not None:
            for module in model.modules():
                module.forward = self.autocasting(module.forward, device)
        if self.compute is not None:
            computing = _Computing(self.compute)
            for module in model.modules():
                if any(True for _ in module.parameters()):
                    module.forward = computing.around(module, module.forward)
        return model

    def autocasting(self, function: Callable, device: torch.device | str) -> Callable:
        """``function`` run under this mode's autocast on ``device`` (a fresh context per call, so nesting is safe)."""
        if self.autocast is None:
            return function
        device_type = torch.device(device).type

        @functools.wraps(function)
        def autocast_call(*args, **kwargs):
            with torch.autocast(device_type, dtype=self.autocast):
                return function(*args, **kwargs)

        return autocast_call

    def grad_scaler_for(self, device: torch.device | str) -> torch.amp.GradScaler:
        """The loss scaler every regime goes through: enabled only in modes that need one (float16).

        It starts at 2^8, not torch's 2^16: at 2^16 small cases overflow in their first steps, and
        whether a step overflows (and GradScaler skips it) depends on how the batch is summed, so full
        batch and accumulation took different steps (measured on an H100: 7 of 150 drawn faithful
        configurations). Any power of two scales exactly; the scale still multiplies every backward.
        """
        return torch.amp.GradScaler(torch.device(device).type, init_scale=GRAD_SCALER_INIT, enabled=self.grad_scaler)


GRAD_SCALER_INIT = 2.0**8


class _Computing:
    """Each module's forward on a ``dtype`` copy of its parameters and on its floating inputs cast, as FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)`` computes a unit. Each module called casts every parameter below it that
    is not a copy yet, each once (a tied weight too): the outermost (the model, or the part a regime calls: a trunk, a
    head) all of them, so code reading a child's parameter directly (a head tied to the embedding) sees the copy; one
    called inside it what a sharding wrapper unsharded as that call began (FSDP2's unit, whose own code may read its
    children's parameters). Each is put back as its call returns. The cast is part of the graph: each gradient reaches its master parameter in the
    master's dtype and accumulates there. A module with running statistics (floating buffers) keeps its parameters
    beside them, as FSDP1's mixed precision leaves BatchNorm out, computing on the 16-bit input it is handed."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.active = dtype, False

    def cast(self, value):
        return value.to(self.dtype) if isinstance(value, Tensor) and value.is_floating_point() else value

    def around(self, module: nn.Module, forward: Callable) -> Callable:
        @functools.wraps(forward)
        def compute_call(*args, **kwargs):
            outermost = not self.active
            held = [(owner, dict(owner._parameters)) for owner in module.modules()
                    if not any(b.is_floating_point() for b in owner.buffers(recurse=False))]
            copies: dict[int, Tensor] = {}
            self.active = True
            try:
                for owner, parameters in held:
                    for name, parameter in parameters.items():
                        if parameter is not None and parameter.is_floating_point() and parameter.dtype != self.dtype:
                            owner._parameters[name] = copies.setdefault(id(parameter), parameter.to(self.dtype))
                return forward(*tree_map(self.cast, args), **tree_map(self.cast, kwargs))
            finally:
                self.active = not outermost
                for owner, parameters in held:
                    owner._parameters.update(parameters)

        return compute_call


def _moved(tensor: Tensor, device: torch.device | str, dtype: torch.dtype) -> Tensor:
    """``tensor`` on ``device``: a floating-point one in ``dtype``, a complex one in the complex dtype of that width
    (``Module.to`` would cast it to ``dtype`` itself, dropping its imaginary part), any other in its own dtype."""
    if tensor.is_complex():
        return tensor.to(device=device, dtype=dtype.to_complex())
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)


SHADOW = "float64-shadow"  # the mode that measures a low-precision run's rounding (equivcheck.judge.rounding)
SCALED_SHADOW = "float64-shadow-scaled"  # the same for a mode with a GradScaler: the scaler's maths included
BF16_SHADOW = "float64-shadow-bf16"  # the same for pure bf16: from the draws rounded to bfloat16, as its run starts
PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("float64", torch.float64, rtol=1e-7, atol=1e-7, description="the default; torch.testing's float64 tolerance"),
    Precision("float32", torch.float32, rtol=1.3e-6, atol=1e-5, description="torch.testing's float32 tolerance"),
    Precision("bf16-autocast", torch.float32, rtol=1.6e-2, atol=2**-8, autocast=torch.bfloat16,
              description="float32 weights, bfloat16 autocast"),
    Precision("fp16-autocast", torch.float32, rtol=2**-9, atol=2**-11, autocast=torch.float16, devices=("cuda",),
              grad_scaler=True, description="float32 weights, float16 autocast and GradScaler on CUDA"),
    Precision("bf16", torch.bfloat16, rtol=1.6e-2, atol=2**-8, draw_dtype=torch.float32,
              description="bfloat16 weights, gradients and optimizer state (pure bf16), drawn in float32"),
    Precision("bf16-master", torch.float32, rtol=1.6e-2, atol=2**-8, compute=torch.bfloat16,
              description="float32 master weights, gradients and optimizer state; bfloat16 parameters and "
                          "activations in forward and backward (FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16))"),
    Precision(SHADOW, torch.float64, rtol=1e-7, atol=1e-7, draw_dtype=torch.float32,
              description="float64 from the float32 draws: the exact maths beside a float32 or autocast run"),
    Precision(BF16_SHADOW, torch.float64, rtol=1e-7, atol=1e-7, draw_dtype=torch.float32, rounded_to=torch.bfloat16,
              description="float64-shadow from the draws rounded to bfloat16: the exact maths beside a pure bf16 run"),
    Precision(SCALED_SHADOW, torch.float64, rtol=1e-7, atol=1e-7, draw_dtype=torch.float32, grad_scaler=True,
              description="float64-shadow through a GradScaler: the exact maths beside an fp16-autocast run"),
)}
SHADOWS = (SHADOW, SCALED_SHADOW, BF16_SHADOW)
PUBLIC_PRECISIONS = tuple(name for name in PRECISIONS if name not in SHADOWS)  # what users choose from
NAMES_OF_DTYPES = {torch.float64: "float64", torch.float32: "float32"}  # what a case may train in
MODES_OF_DTYPES = {**NAMES_OF_DTYPES, torch.bfloat16: "bf16"}  # a plain dtype= a check is asked for


def resolve_precision(dtype: str | torch.dtype | Precision | None, default: torch.dtype = torch.float64) -> Precision:
    """A mode name (``'bf16-autocast'``), a plain dtype, a Precision, or None for ``default``."""
    if dtype is None:
        dtype = default
    if isinstance(dtype, Precision):
        return dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in MODES_OF_DTYPES:
            raise InvalidArgument.value("dtype", dtype, f"{', '.join(map(str, MODES_OF_DTYPES))} (or a mode name)")
        return PRECISIONS[MODES_OF_DTYPES[dtype]]
    if not isinstance(dtype, str):
        raise InvalidArgument.type("dtype", dtype, f"a precision name ({', '.join(PRECISIONS)}) or a torch.dtype")
    if KERNELS_SEPARATOR in dtype:  # from another process: the mode on the kernel path that process chose
        name, kernels = dtype.split(KERNELS_SEPARATOR, 1)
        return dataclasses.replace(resolve_precision(name), kernels=path_named(kernels).name)
    if dtype not in PRECISIONS:
        raise InvalidArgument.unknown("dtype", dtype, PRECISIONS)
    return PRECISIONS[dtype]


KERNELS_SEPARATOR = "@"  # 'bf16-autocast@mkldnn-off': a mode and its kernel path, as another process is told them


def registered_name(precision: Precision) -> str:
    """The name another process can look ``precision`` up by, with its kernel path where one was chosen; only
    registered modes cross processes."""
    if PRECISIONS.get(precision.name) != dataclasses.replace(precision, kernels=None):
        raise InvalidArgument.value("dtype", precision.name, f"one of {', '.join(PRECISIONS)} for distributed regimes")
    return precision.name + (KERNELS_SEPARATOR + precision.kernels if precision.kernels else "")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An element matches when ``|actual - expected| <= atol + rtol * |expected|``. ``source`` says where a
    tolerance other than the precision mode's (or the call's, or the case's) came from: a lossy regime's own
    error bound (a compressing DDP comm hook) names itself there, and every report prints it."""

    rtol: float
    atol: float
    source: str = ""

    @classmethod
    def resolve(
        cls, dtype: torch.dtype | Precision, rtol: float | None = None, atol: float | None = None
    ) -> Tolerance:
        """The call's override if given, else the precision mode's stated tolerance; rtol and atol go together."""
        expect_tolerances(rtol, atol)
        if rtol is None:
            precision = resolve_precision(dtype)
            rtol, atol = precision.rtol, precision.atol
        if rtol == 0 and atol == 0:
            raise InvalidArgument.value("atol", atol, "rtol or atol above 0 (a zero tolerance has no margin)")
        return cls(float(rtol), float(atol))

    def widened(self, rtol: float, atol: float, source: str) -> Tolerance:
        """This tolerance with a lossy step's own error bound added: the mode's reordering error and the
        compression's add up, element by element."""
        return Tolerance(self.rtol + rtol, self.atol + atol, source)

    def __str__(self) -> str:
        return f"rtol={self.rtol:g}, atol={self.atol:g}" + (f": {self.source}" if self.source else "")
