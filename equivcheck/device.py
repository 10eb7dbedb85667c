"""Where a run trains: the device a check names, and the one rule that places ranks and children on a machine.

A check trains on the device its caller names: the CPU by default, ``cuda`` on request. Everything it compares (the
reference, its repeat, the witness, the float64 shadows) trains there too. Ranks follow one rule, here and nowhere
else: nccl with a GPU per rank where the device is ``cuda`` and there are enough GPUs, else gloo ranks on the CPU,
with the reason in the verdict; never a model on one device and its batch on another.

A machine with a GPU changes what a process may fork. A process's first backward there starts autograd's device
threads, and a child forked after that cannot run backward at all; a process that has asked CUDA anything (even how
many devices it has) leaves its children unable to start CUDA. So children that train come from a process that never
trained (``process.forking.fork_is_safe`` says when this one may fork them itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator

import torch

from .errors import InvalidArgument

DEVICES = ("cpu", "cuda")
DEFAULT_DEVICE = "cpu"  # the built-in cases are tiny: the CPU checks them faster than a kernel launch per op
BACKENDS = ("auto", "gloo", "nccl")
# Where a run's recording goes that its own device does not keep (runners/train.py's snapshot): one name for every
# such copy, so that a test can send them elsewhere ("meta") and count what crosses (tests/test_anchored.py).
HOST = torch.device("cpu")
# cuBLAS picks its reduction order by workspace unless told one: torch's reproducibility notes ask for this setting
# before the first cuBLAS call, where use_deterministic_algorithms(True) would otherwise refuse cuBLAS kernels.
CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(device: str | torch.device | None) -> str:
    """``'cpu'`` or ``'cuda'`` from what a caller gave (None: the CPU); anything else is a usage error naming it."""
    if device is None:
        return DEFAULT_DEVICE
    if isinstance(device, torch.device):
        if device.index not in (None, 0):
            raise InvalidArgument.value("device", str(device), "'cpu' or 'cuda' (ranks take a GPU each: cuda:0 onwards)")
        device = device.type
    if not isinstance(device, str):
        raise InvalidArgument.type("device", device, "'cpu' or 'cuda'")
    if device == "cuda:0":
        device = "cuda"
    if device not in DEVICES:
        raise InvalidArgument.unknown("device", device, DEVICES)
    return device


_chosen: list[str] = []  # the devices a caller chose for every check in a scope (the command's --device), innermost last


@contextlib.contextmanager
def chosen(device: str | torch.device | None) -> Iterator[None]:
    """Every check inside trains on ``device`` unless it names its own (None: as outside): how the command's
    ``--device`` reaches the field's rows and the catalogue's plans, which make their checks themselves."""
    if device is None:
        yield
        return
    _chosen.append(resolve_device(device))
    try:
        yield
    finally:
        _chosen.pop()


def device_for(device: str | torch.device | None, precision_default: str) -> str:
    """The device a check trains on: the one it names, else the scope's chosen one, else its precision's default."""
    if device is not None:
        return resolve_device(device)
    return _chosen[-1] if _chosen else precision_default


def gpus() -> int:
    """How many CUDA devices this process may use (0 on a CPU build or a machine without one)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing(device: str) -> str | None:
    """Why this machine cannot train on ``device`` (None when it can): a check there is skipped, never faked."""
    if device == "cuda" and gpus() == 0:
        return "device='cuda' needs a CUDA device and torch.cuda.is_available() is False here"
    return None


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where the ranks of one distributed run train: their backend, and why that is not the device the check named
    (``note``, '' when it is)."""

    backend: str
    note: str = ""

    @property
    def on_gpus(self) -> bool:
        return self.backend == "nccl"


def place_ranks(world_size: int, device: str, backend: str = "auto") -> RankPlacement:
    """The rule for ``world_size`` ranks of a check on ``device``: a backend named in the spec is kept (nccl then
    needs a GPU per rank: the regime says so); ``'auto'`` is nccl with a GPU per rank on ``cuda`` where there are
    enough, else gloo on the CPU, saying why."""
    if backend == "nccl":
        return RankPlacement("nccl")
    if device != "cuda":
        return RankPlacement("gloo")
    if backend == "gloo":
        return RankPlacement("gloo", f"backend=gloo: the {world_size} ranks train on the CPU")
    found = gpus()
    if found >= world_size:
        return RankPlacement("nccl")
    return RankPlacement("gloo", f"device='cuda': {world_size} ranks need a GPU each and {found} "
                                 f"{'is' if found == 1 else 'are'} here: gloo ranks on the CPU")


def auto_backend(device: str = DEFAULT_DEVICE) -> str:
    """What backend 'auto' means for a check on ``device`` here, in words (report headers)."""
    found = gpus()
    if device != "cuda" or found == 0:
        return "gloo"
    return f"nccl up to {found} rank{'s' * (found > 1)} (a GPU each), gloo beyond"


def rank_device(backend: str, rank: int) -> torch.device:
    """Where rank ``rank`` of a group on ``backend`` trains: its own GPU under nccl, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


@contextlib.contextmanager
def deterministic(device: str) -> Iterator[None]:
    """Kernels as torch documents reproducibility on ``device``: on CUDA, deterministic algorithms where torch has
    them, no TF32 and no cuDNN autotuning; the CPU's are deterministic already. A kernel torch has no deterministic
    form of still runs (an exact one, such as a histogram of integer counts, must not end a check): torch warns, the
    kernel is noted (:data:`NONDETERMINISTIC_KERNELS`), and the reference trained twice shows whether it mattered
    (a ``nondeterministic`` verdict naming it). The settings before are restored after."""
    if device != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    settings = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.benchmark = False
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            yield
        for warning in warned:
            if NONDETERMINISTIC_KERNEL in str(warning.message):
                NONDETERMINISTIC_KERNELS.add(str(warning.message).split(NONDETERMINISTIC_KERNEL)[0].strip())
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    finally:
        enabled, warn_only, matmul_tf32, cudnn_tf32, benchmark = settings
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
        torch.backends.cudnn.benchmark = benchmark


NONDETERMINISTIC_KERNEL = "does not have a deterministic implementation"  # torch's words for such a kernel
NONDETERMINISTIC_KERNELS: set[str] = set()  # the kernels torch named so in this process


def is_nondeterministic_kernel(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a kernel without a deterministic implementation."""
    return NONDETERMINISTIC_KERNEL in str(error)


def free_bytes(device: torch.device) -> int | None:
    """The memory free on a GPU now (CUDA's own count), None on the CPU: a process's memory is not one pool there."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]
