"""Context parallelism: torch's ``context_parallel`` over W ranks, each holding its shard of every sequence.

Every rank takes the whole global batch and ``context_parallel`` cuts its inputs and targets along the sequence
(dimension 1; torch's head-tail load balancing where the length divides into 2 W pieces) and replaces
``scaled_dot_product_attention`` with its ring attention, which passes keys and values between the ranks. A rank's
loss is its tokens' sum times W over the global batch's items, and DDP averages the parameters' gradients over the
ranks, so the step is the full batch's.

Whether torch can run it here is measured, never assumed: a probe (once per process and per device and dtype, in a
child process so that no process group is made here) runs causal attention forward and backward under
``context_parallel`` on a mesh of one rank, with torch's default attention backend and then with the math backend
(``sdpa_kernel(SDPBackend.MATH)``). Where both are refused the regime is unavailable, and every check under it is
skipped with torch's own words; nothing is emulated. Measured with torch 2.13 on the CPU: refused either way (the
CPU's attention kernel has no DTensor sharding strategy; the math backend mixes its causal mask, a plain tensor,
with DTensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..case import Case
from ..device import DEFAULT_DEVICE
from ..errors import InvalidArgument
from ..process.import_paths import WITHOUT_WORKING_DIRECTORY
from ..process.seeding import DEFAULT_SEED, seeded
from .base import finish_step
from .ddp import Distributed

SDPA_BACKENDS = ("auto", "default", "math")
PROBE_TIMEOUT = 120.0  # seconds: a child that imports torch and trains one attention call on one rank

# Run by ``sys.executable -c`` with the device type, the dtype's name, "causal" (or "full") and the attention
# backends to try in turn ("default,math"): prints one JSON object, the SDPA backend that ran (``"default"``,
# ``"math"`` or null) and, for each backend refused, torch's exception as "<type>: <message>".
_PROBE = r"""
import contextlib, json, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F

device, dtype, causal = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "causal"
backends = sys.argv[4].split(",")
if device == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

mesh = init_device_mesh(device, (1,))
found = {"ran": None, "refused": {}}
for backend in backends:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, device=device, dtype=dtype) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            with sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                F.scaled_dot_product_attention(*leaves, is_causal=causal).sum().backward()
    except Exception as error:
        found["refused"][backend] = f"{type(error).__name__}: {error}".strip()
    else:
        found["ran"] = backend
        break
dist.destroy_process_group()
print(json.dumps(found))
"""


@dataclasses.dataclass(frozen=True)
class Probed:
    """What the probe found on one device in one dtype: the attention backend that ran, or why none did."""

    device: str
    dtype: str
    causal: bool
    ran: str | None  # "default" or "math"; None: refused
    refused: dict[str, str]  # backend -> torch's words
    failure: str = ""  # the probe itself did not answer (crashed, hung): why

    def reason(self) -> str | None:
        """Why ``cp`` cannot run here, in torch's words; None where the probe ran."""
        if self.ran is not None:
            return None
        where = f"torch {torch.__version__} on {self.device} in {self.dtype}"
        if self.failure:
            return f"context_parallel could not be tried ({where}): {self.failure}"
        named = {"default": "the default backend", "math": "the math backend (sdpa_kernel(SDPBackend.MATH))"}
        said = "; ".join(f'{named[backend]} refused it: "{words}"' for backend, words in self.refused.items())
        attention = "causal" if self.causal else "non-causal"
        return (f"torch's context_parallel cannot run {attention} scaled_dot_product_attention here ({where}; measured "
                f"by a probe, forward and backward on a mesh of one rank): {said}")


@functools.cache
def probe(device: str, dtype: str, causal: bool = True, backends: tuple[str, ...] = ("default", "math")) -> Probed:
    """Run the probe in a child process (once per process for each device, dtype and backends): a process group made
    here would change this process, a warm pool's parent or a launcher's rank. About 2 s on this CPU for causal
    attention; 9 s for non-causal with the default backend, whose forward DTensor propagates through the kernel's
    decomposition before refusing its backward."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        arguments = [device, dtype, "causal" if causal else "full", ",".join(backends)]
        done = subprocess.run([sys.executable, "-c", WITHOUT_WORKING_DIRECTORY + _PROBE, *arguments], capture_output=True,
                              text=True,
                              timeout=PROBE_TIMEOUT, env=env, check=False)
    except subprocess.TimeoutExpired:
        return Probed(device, dtype, causal, None, {}, f"the probe gave no answer within {PROBE_TIMEOUT:g} s")
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return Probed(device, dtype, causal, None, {},
                      f"the probe ended without an answer (exit status {done.returncode}): {tail}")
    return Probed(device, dtype, causal, found["ran"], found["refused"])


def attention_dtype(precision) -> torch.dtype:
    """The dtype attention computes in: autocast's or the compute copy's where the mode has one, else the parameters'."""
    return precision.computes_in


@dataclasses.dataclass(frozen=True)
class ContextParallel(Distributed):
    name = "cp"
    summary = ("context parallelism: torch's context_parallel over W ranks, each the whole batch's sequence shard, "
               "DDP averaging; skipped where torch refuses this machine's attention, in torch's words")
    # Only attention cases on sequences fit, as only some cases have a tensor-parallel plan: drawn only when named.
    fits_some_cases = True  # attention over a sequence the ranks can split
    # The attention the probe tries: causal, as a language model's (every attention case built in). A subclass for
    # models whose attention is not causal may probe that instead (tests/test_hsdp_cp.py runs one on the CPU).
    causal: ClassVar[bool] = True
    # The attention backend: "auto" (torch's default where the probe runs it, else the math one), "default" or "math".
    sdpa: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sdpa not in SDPA_BACKENDS:
            raise InvalidArgument.value("sdpa", self.sdpa, f"one of {', '.join(SDPA_BACKENDS)}")

    def probed(self, device: str, dtype: str) -> Probed:
        return probe(device, dtype, self.causal, ("default", "math") if self.sdpa == "auto" else (self.sdpa,))

    def validate(self, case: Case) -> None:
        """Inputs and targets must be sequences (a sample's dimension 1) whose length divides over the ranks."""
        super().validate(case)
        try:
            with seeded(DEFAULT_SEED):
                inputs, targets = case.data()[:2]
        except Exception:  # data that cannot be made here: training tells
            return
        shapes = [tuple(getattr(t, "shape", ())) for t in (inputs, targets)]
        if any(len(shape) < 2 for shape in shapes) or shapes[0][1] != shapes[1][1]:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: context parallelism shards sequences, and this case's "
                f"inputs {list(shapes[0])} and targets {list(shapes[1])} are not (expected both samples x sequence "
                "x ..., the same length: an attention case over tokens)")
        if shapes[0][1] % self.world_size:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: its sequences of {shapes[0][1]} do not divide over "
                f"world_size={self.world_size}")

    def unavailable_in(self, precision, device: str = DEFAULT_DEVICE) -> str | None:
        device = "cuda" if self.placement(device).on_gpus else "cpu"
        dtype = str(attention_dtype(precision)).removeprefix("torch.")
        return self.probed(device, dtype).reason()

    def train_step(self, model, optimizer, batch, objective):
        """The whole global batch on every rank, its inputs and targets cut along the sequence by context_parallel;
        forward and backward inside it, with the attention backend asked for or (auto) the one the probe ran."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        device = next(model.parameters()).device.type
        ran = self.sdpa if self.sdpa != "auto" else \
            self.probed(device, str(attention_dtype(objective.precision)).removeprefix("torch.")).ran
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        inputs, targets = batch.inputs.clone(), batch.targets.clone()  # context_parallel shards its buffers in place
        kernel = sdpa_kernel(SDPBackend.MATH) if ran == "math" else contextlib.nullcontext()
        with context_parallel(mesh, buffers=[inputs, targets], buffer_seq_dims=[1, 1]), kernel:
            loss = self.rank_part(objective, batch)(objective.forward(model, inputs, targets), targets)
            objective.backward(loss)
        finish_step(optimizer, objective)
        return loss.detach() / self.world_size

    def wrap(self, model: nn.Module, objective) -> nn.Module:
        """DDP over the context-parallel ranks: each rank's parameter gradients come from its tokens alone."""
        return self.ddp(model)
