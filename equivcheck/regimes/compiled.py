"""torch.compile as a wrap: any regime with ``compile=inductor`` (or ``aot_eager``) in its spec trains the module its
wrap returns compiled, ``torch.compile(module, backend=...)`` (``ddp:world_size=2,compile=inductor`` compiles the DDP
wrapper, whose graphs DDP's optimizer breaks at its buckets, as torch intends). Everything else is the regime's own:
the compiled regime is a subclass of it, made once per regime class, so it is what the regime is, and its spec prints
back with the option. The reference stays eager: a compiled run is judged against the maths.

A compile that compiles nothing would be an eager run called compiled (a regime whose steps call the model's parts, not
the module that was compiled; ``nn.Module.compile()``, which torch 2.13 leaves eager, its frames in dynamo's skip
list): a compiled run whose module was never called, or whose backend has compiled no graph in this process, is an
error saying so. The backend is one counting callable per name, so dynamo's cache serves a check's later runs (as it
serves a team's): only the first compiles. Inductor draws dropout's masks as eager does (``fallback_random``): its
own generator would draw other masks than the reference's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import shutil
from collections.abc import Iterator

from torch import nn

from ..device import DEFAULT_DEVICE
from ..errors import InvalidArgument

BACKENDS = ("inductor", "aot_eager")
CALLS_ATTRIBUTE = "_equivcheck_compiled_calls"  # on the case's model: the calls of its compiled module in this run
# Inductor draws random numbers (dropout's masks) from a generator of its own unless told to fall back on eager's: then
# a compiled run draws what the eager reference draws (measured: without it, one dropout layer under compile=inductor
# mismatched full batch from step 0)
INDUCTOR_SETTINGS = {"fallback_random": True}
# A compiled backward may give its saved buffers away ("donated buffers", a memory saving), which a second backward
# over the same graph cannot use: torch then refuses retain_graph. Dynamo's cache serves a graph compiled for one regime
# to the next, so retained_graph met graphs compiled for accumulate and was an error (7 of 100 drawn configurations,
# bench_false_alarms.py --compiled 100 --compile-backend aot_eager --seed 3). Kept, they change no number.
FUNCTORCH_SETTINGS = {"donated_buffer": False}


@functools.cache
def compiled_class(regime_class: type) -> type:
    """The class of ``regime_class``'s regimes trained compiled: a subclass with the ``compile`` option."""

    @dataclasses.dataclass(frozen=True)
    class Compiled(regime_class):
        compile: str = dataclasses.field(default="", kw_only=True, metadata={"trailing": True, "example": "inductor"})
        # the backward traced and compiled too (torch's compiled autograd), by the same backend
        compiled_autograd: bool = dataclasses.field(default=False, kw_only=True, metadata={"trailing": True})
        # the optimizer's step compiled too, by the same backend (torch.compile(optimizer.step))
        compile_optimizer: bool = dataclasses.field(default=False, kw_only=True, metadata={"trailing": True})

        def __post_init__(self) -> None:
            checked = getattr(super(), "__post_init__", None)
            if checked is not None:
                checked()
            if self.compile not in BACKENDS:
                raise InvalidArgument.value("compile", self.compile, f"one of {', '.join(BACKENDS)}")

        def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
            if self.compiled_autograd and self.distributed:
                return ("compiled_autograd=1 on ranks: DDP's C++ reducer refuses compiled autograd and torch asks for "
                        "its Python reducer (torch._dynamo.config.optimize_ddp='python_reducer'), which all-reduces "
                        "each parameter through the comm hook equivcheck counts buckets with: not supported yet")
            return super().unavailable(device) or missing_compiler(self.compile, device)

        def wrap(self, model: nn.Module, objective) -> nn.Module:
            return compile_module(super().wrap(model, objective), model, self.compile)

        def build_optimizer(self, case, model):
            optimizer = super().build_optimizer(case, model)
            return compile_step(optimizer, model, self.compile) if self.compile_optimizer else optimizer

        def random_streams(self, model, optimizer, inputs):
            return _compiled_something(super().random_streams(model, optimizer, inputs), model, str(self),
                                       self.compile, self.compiled_autograd, self.compile_optimizer)

    Compiled.__name__ = Compiled.__qualname__ = f"Compiled{regime_class.__name__}"
    return Compiled


def missing_compiler(backend: str, device: str) -> str | None:
    """Why ``backend`` cannot compile for ``device`` here: inductor writes C++ for the CPU, which needs a compiler."""
    if backend != "inductor" or device != "cpu":
        return None
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if any(shutil.which(compiler) for compiler in compilers if compiler):
        return None
    return "compile=inductor writes C++ for the CPU and no C++ compiler is here (CXX, g++, c++, clang++): aot_eager runs"


# graphs each counting backend compiled in this process, by backend and what it compiled
_GRAPHS: collections.Counter[tuple[str, str]] = collections.Counter()
STEP_CALLS_ATTRIBUTE = "_equivcheck_compiled_steps"  # on the case's model: the calls of its compiled optimizer step


@functools.cache
def counting_backend(backend: str, what: str = "module"):
    """``backend``, counting every graph it compiles for ``what`` (the module, or the optimizer's step): one callable
    per name, so dynamo's cache serves a check's later runs (and the next check's) instead of compiling them again."""
    import torch._dynamo

    real = torch._dynamo.lookup_backend(backend)

    def counted(graph_module, example_inputs):
        _GRAPHS[backend, what] += 1
        return real(graph_module, example_inputs)

    return counted


def compile_module(module: nn.Module, model: nn.Module, backend: str) -> nn.Module:
    """``module`` compiled with ``backend``; each call of it noted on ``model``."""
    import torch

    calls: list[int] = []
    compiled = torch.compile(module, backend=counting_backend(backend))
    compiled.register_forward_pre_hook(lambda *_: calls.append(1))
    object.__setattr__(model, CALLS_ATTRIBUTE, calls)
    return compiled


def compile_step(optimizer, model: nn.Module, backend: str):
    """``optimizer`` with its step compiled by ``backend`` (its hooks, the recording's among them, run inside it, as
    dynamo leaves them); each call noted on ``model``."""
    import torch

    calls: list[int] = []
    eager = optimizer.step
    compiled = torch.compile(eager, backend=counting_backend(backend, "optimizer"))

    def step(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    optimizer.step = step
    object.__setattr__(model, STEP_CALLS_ATTRIBUTE, calls)
    return optimizer


@contextlib.contextmanager
def _compiled_something(inner, model: nn.Module, regime: str, backend: str, autograd: bool,
                        optimizer: bool = False) -> Iterator[None]:
    """Training in ``inner`` (every backward under compiled autograd where ``autograd``), then an error where the
    compiled module was never called or its backend never compiled a graph in this process (the run was eager), or
    where no backward was captured."""
    import torch
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    captured = counters["compiled_autograd"]["captures"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._inductor.config.patch(**INDUCTOR_SETTINGS))
        stack.enter_context(torch._functorch.config.patch(**FUNCTORCH_SETTINGS))
        stack.enter_context(inner)
        if autograd:
            stack.enter_context(compiled_autograd._enable(torch.compile(backend=backend)))
        yield
    if not getattr(model, CALLS_ATTRIBUTE, None) or not _GRAPHS[backend, "module"]:
        raise RuntimeError(f"{regime} compiled nothing: its steps never called the module torch.compile wrapped "
                           "(a regime that drives the model's parts), so the run was eager")
    if autograd and counters["compiled_autograd"]["captures"] == captured:
        raise RuntimeError(f"{regime} captured no backward under compiled autograd: the backward ran eager")
    if optimizer and (not getattr(model, STEP_CALLS_ATTRIBUTE, None) or not _GRAPHS[backend, "optimizer"]):
        raise RuntimeError(f"{regime} compiled no optimizer step: its optimizer's step was never called through "
                           "torch.compile, or compiled no graph, so it ran eager")
