"""Kernel paths: before a CPU autocast precision's first run in a process, prove its kernels can run here.

oneDNN picks its CPU kernels by the instructions a CPU advertises. On some virtual CPUs that advertise AMX,
its bf16 brgemm kernels die of SIGILL at their first tile instruction, and take the process with them. So a
process probes a CPU autocast precision before its first run: a forward and backward of what autocast sends
to those kernels (linear, convolution, batched matmul, LSTM), at sizes that take the fast paths, in a forked
child (a fresh interpreter on a machine with a GPU, where a fork of a process that trained cannot run backward). Where the child dies, the next path is probed:

1. torch's default kernels;
2. oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA``). oneDNN reads it once, at its first kernel, so it works only
   in a process that has run none yet; the probe's child, a fork of this process, shows whether that holds;
3. mkldnn off around the precision's runs (``torch.backends.mkldnn.flags(enabled=False)``): ATen's own kernels.

The path used, and why, is in every outcome's note, the report's metadata and the catalogue's header; where
no path works the precision is skipped with the signal and the way out. Numerics never change silently.
CUDA precisions are not probed: a GPU kernel's fault reaches Python as an exception, an ``error`` verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from .forking import fork_is_safe
from ..errors import InvalidArgument
from .exit import exit_words
from .import_paths import WITHOUT_WORKING_DIRECTORY, search_path


@dataclasses.dataclass(frozen=True)
class KernelPath:
    """A way to run a precision's kernels: variables oneDNN reads at its first kernel, and whether mkldnn is on."""

    name: str
    description: str
    environment: tuple[tuple[str, str], ...] = ()
    mkldnn: bool = True

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Around a run: mkldnn off where this path says so (its environment is set once, by :func:`decide`)."""
        if self.mkldnn:
            yield
        else:
            with torch.backends.mkldnn.flags(enabled=False):
                yield


DEFAULT = KernelPath("default", "torch's default kernels")
ISA_CAPPED = KernelPath("onednn-avx512", "oneDNN capped below AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)",
                        environment=(("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"),))
MKLDNN_OFF = KernelPath("mkldnn-off", "mkldnn off around its runs (ATen's own kernels, not oneDNN's)", mkldnn=False)
PATHS = {path.name: path for path in (DEFAULT, ISA_CAPPED, MKLDNN_OFF)}
PROBE_SECONDS = 60.0  # a probe that runs longer hung: that path does not work here


def path_named(name: str) -> KernelPath:
    if name not in PATHS:
        raise InvalidArgument.unknown("kernel path", name, PATHS)
    return PATHS[name]


@dataclasses.dataclass(frozen=True)
class Decision:
    """How a precision's kernels run in this process, and the probes that chose it."""

    precision: str
    path: KernelPath | None  # None: no path survived its probe
    tried: tuple[tuple[str, str], ...]  # (path, how its probe's child ended), in the order probed

    @property
    def note(self) -> str:
        """What a reader must be told: nothing where the default path ran."""
        if self.path is DEFAULT:
            return ""
        failed = "; ".join(f"{name} {how}" for name, how in self.tried if how != "ran")
        if self.path is None:
            return (f"{self.precision}: no kernel path survives here ({failed}); a CPU whose oneDNN kernels fault "
                    "(AMX in some virtual machines): run this precision on another machine, or check in float32")
        return f"{self.precision} ran on kernel path {self.path.name}: {self.path.description}; probed: {failed}"

    @property
    def summary(self) -> str:
        """One line for a report's metadata, default path included."""
        return self.note or f"{self.precision}: {DEFAULT.description} (probe ran)"


_decisions: dict[str, Decision] = {}


def decisions() -> dict[str, Decision]:
    """Every precision this process has probed, by name: what reports print as their kernel paths."""
    return dict(_decisions)


def needs_probe(precision, device: str) -> bool:
    """Only the CPU's 16-bit kernels die with their process (a GPU kernel's fault reaches Python as an exception)."""
    return precision.low and device == "cpu"


def decide(precision) -> Decision:
    """The kernel path of ``precision`` in this process, probed on first use; a path's environment is set here."""
    if precision.name not in _decisions:
        tried = []
        chosen = None
        for path in PATHS.values():
            how = probe(precision, path)
            tried.append((path.name, how))
            if how == "ran":
                chosen = path
                os.environ.update(dict(path.environment))  # before this process's first oneDNN kernel, as probed
                break
        _decisions[precision.name] = Decision(precision.name, chosen, tuple(tried))
    return _decisions[precision.name]


def probe(precision, path: KernelPath) -> str:
    """Run :func:`probe_kernels` on ``path`` in a child: ``'ran'``, or how the child died. The child is a fork of this
    process where that child can run backward (a machine without a GPU: equivcheck.device), else a fresh interpreter."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if not fork_is_safe():
        return _probe_in_fresh_interpreter(precision, path)
    with warnings.catch_warnings():  # Python 3.12 warns on forking a threaded process; the probe runs no thread's work
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            faulthandler.disable()  # a probe's death is an answer, told by its signal: no dump onto the user's terminal
            torch.set_num_threads(1)  # OpenMP's pool does not survive a fork: this process's would hang the child
            os.environ.update(dict(path.environment))
            with path.applied():
                probe_kernels(precision)
        finally:
            os._exit(0)
    deadline = time.monotonic() + PROBE_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return _how(os.waitstatus_to_exitcode(status))
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return _hung()
        time.sleep(0.002)


def _how(code: int) -> str:
    return "ran" if code == 0 else f"died ({exit_words(code)})"


def _hung() -> str:
    return f"hung past {PROBE_SECONDS:g} s"


PROBE_COMMAND = WITHOUT_WORKING_DIRECTORY + "from equivcheck.process.kernels import probe_main; probe_main()"


def _probe_in_fresh_interpreter(precision, path: KernelPath) -> str:
    """The probe in a new interpreter (a second's import of torch): on a machine with a GPU no fork of a process that
    may have trained can run backward."""
    try:
        autocast = str(precision.computes_in).removeprefix("torch.")
        done = subprocess.run([sys.executable, "-c", PROBE_COMMAND, autocast, path.name],
                              env=os.environ | dict(path.environment) | {"PYTHONPATH": os.pathsep.join(search_path())},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        return _hung()
    return _how(done.returncode)


def probe_main() -> None:
    """The fresh interpreter's probe: the autocast dtype and the path are named by the command line."""
    faulthandler.disable()
    torch.set_num_threads(1)
    autocast, path = sys.argv[1:3]
    with path_named(path).applied():
        probe_kernels(types.SimpleNamespace(computes_in=getattr(torch, autocast)))


def probe_kernels(precision) -> None:
    """What autocast sends to the fast kernels, forward and backward, at sizes that take them (a 32 x 32 linear
    reaches oneDNN's AMX brgemm; an 8 x 8 one does not): a mode whose parameters are 16-bit runs the same kernels."""
    torch.manual_seed(0)
    workloads = [(nn.Linear(128, 128), torch.randn(64, 128)),
                 (nn.Conv2d(16, 32, 3, padding=1), torch.randn(8, 16, 16, 16)),
                 (nn.LSTM(64, 64, batch_first=True), torch.randn(8, 16, 64)),
                 (lambda x: torch.bmm(x, x.transpose(1, 2)), torch.randn(8, 64, 64, requires_grad=True))]
    for forward, inputs in workloads:
        with contextlib.suppress(Exception):  # an op that raises kills nothing: the runs will say what it raised
            with torch.autocast("cpu", dtype=precision.computes_in):
                output = forward(inputs)
                output = output[0] if isinstance(output, tuple) else output
            output.float().square().mean().backward()
