"""Cases that misbehave inside a process group: rank 1 raises, hangs or is killed by SIGKILL (``fault_late_kill``:
after rank 0 has raised, as a peer's broken collective does when rank 1 dies); every rank is slow; rank 0
interrupts the process that started the pool (SIGINT or SIGTERM, as Ctrl-C or a job scheduler would) in
the middle of the job.

On a single process (the reference run) they train normally, so only the distributed job fails.
"""

import dataclasses
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import equivcheck as ec
from equivcheck.runners.ranks.worker import INSIDE_RANK_VARIABLE


def pool_owner() -> int:
    """The process whose pool this rank serves: the parent of the forker that forked it."""
    with open(f"/proc/{os.getppid()}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def the_command() -> int:
    """The process running the check an isolated run belongs to: the parent of the forked child it trains in, or,
    where it trains on a clean child (a GPU machine's one-rank worker), that worker's pool owner."""
    return pool_owner() if os.environ.get(INSIDE_RANK_VARIABLE) is not None else os.getppid()


_signalled: set[str] = set()


def once(signal_name: str) -> bool:
    """True the first time in this rank: one Ctrl-C, not one per step (a second one would land in the parent's
    own shutdown, whenever the rank outlives the parent's 1 s grace by a step)."""
    first = signal_name not in _signalled
    _signalled.add(signal_name)
    return first


class Faulty(nn.Module):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.fault = fault

    def forward(self, x):
        if dist.is_initialized() and self.fault == "slow":
            time.sleep(1.0)  # a job that takes seconds: time to interrupt it
        if dist.is_initialized() and dist.get_rank() == 0 and self.fault == "sigint" and once("sigint"):
            os.killpg(os.getpgid(pool_owner()), signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
            time.sleep(1.0)  # still working on the job when the parent stops
        if dist.is_initialized() and dist.get_rank() == 0 and self.fault == "sigint_twice" and once("sigint"):
            os.killpg(os.getpgid(pool_owner()), signal.SIGINT)
            time.sleep(0.3)  # the parent is closing its pool now, waiting for this rank to stop
            os.killpg(os.getpgid(pool_owner()), signal.SIGINT)  # an impatient second Ctrl-C
            time.sleep(1.0)
        if dist.is_initialized() and dist.get_rank() == 0 and self.fault == "sigterm" and once("sigterm"):
            os.kill(pool_owner(), signal.SIGTERM)  # a job scheduler stops the parent
            time.sleep(1.0)
        if dist.is_initialized() and dist.get_rank() == 1:
            if self.fault == "raise":
                raise RuntimeError("injected fault on rank 1")
            if self.fault == "hang":
                time.sleep(3600)  # rank 0 waits in DDP's all-reduce for a rank that never comes
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "late_kill":
                time.sleep(0.3)  # rank 0's error reaches the parent first
                os.kill(os.getpid(), signal.SIGKILL)
        if dist.is_initialized() and dist.get_rank() == 0 and self.fault == "late_kill":
            raise RuntimeError("rank 0's collective broke: its peer is gone")
        return self.linear(x)


for fault in ("raise", "hang", "kill", "late_kill", "slow", "sigint", "sigint_twice", "sigterm"):
    ec.register_case(dataclasses.replace(
        ec.get_case("mlp"), name=f"fault_{fault}", model=lambda fault=fault: Faulty(fault), split=None, regimes=None,
    ))

# The same faults on a case that declares its DDP regime a pitfall: a rank that raises is evidence about the
# code checked; a rank that dies is not, and must never read as the pitfall caught.
for fault in ("raise", "kill"):
    ec.register_case(dataclasses.replace(
        ec.get_case(f"fault_{fault}"), name=f"declared_fault_{fault}",
        expect_mismatch={"ddp": "a declared pitfall under DDP"},
    ))


class Crashing(nn.Module):
    """Kills its own process in a forward over fewer samples than the global batch (a micro-batch, or a rank's
    shard), as a kernel that faults on some shapes does: the reference trains, every split run dies. ``signum``
    0 leaves through ``os._exit(3)`` instead of a signal."""

    def __init__(self, signum: int, batch_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.signum, self.batch_size = signum, batch_size

    def forward(self, x):
        if x.shape[0] < self.batch_size:
            if self.signum:
                os.kill(os.getpid(), self.signum)
            os._exit(3)
        return self.linear(x)


for name, signum in (("sigsegv", signal.SIGSEGV), ("sigill", signal.SIGILL), ("exit", 0)):
    ec.register_case(dataclasses.replace(
        ec.get_case("mlp"), name=f"crash_{name}", split=None, regimes=None,
        model=lambda signum=signum: Crashing(signum, ec.get_case("mlp").batch_size),
    ))


# A crash that declares a pitfall: a catalogue entry of it is an error row (registered here, at the top level, so
# that an isolating child that imports it by name, a GPU machine's, knows it too).
ec.register_case(dataclasses.replace(ec.get_case("crash_sigsegv"), name="crash_declared",
                                     expect_mismatch={"naive_accumulate": "a planted pitfall"}))


class MkldnnFaults(nn.Module):
    """A run on a machine whose oneDNN bf16 kernels fault: its first autocast forward with mkldnn on kills the
    process with SIGILL, as oneDNN's AMX path does on some virtual CPUs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and torch._C._get_mkldnn_enabled():
            os.kill(os.getpid(), signal.SIGILL)
        return self.linear(x)


class IsaFaults(nn.Module):
    """The same machine, where only capping oneDNN's ISA saves a run: an autocast forward in a process whose
    environment lacks ONEDNN_MAX_CPU_ISA dies of SIGILL."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and "ONEDNN_MAX_CPU_ISA" not in os.environ:
            os.kill(os.getpid(), signal.SIGILL)
        return self.linear(x)


for name, model in (("mkldnn_faults", MkldnnFaults), ("isa_faults", IsaFaults)):
    ec.register_case(dataclasses.replace(ec.get_case("mlp"), name=name, model=model, split=None, regimes=None))


class Interrupting(nn.Module):
    """Stops the command from inside an isolated run over fewer samples than the global batch: Ctrl-C at a
    terminal (SIGINT to the whole process group, the run's child included) or a scheduler's SIGTERM to the
    command; then keeps training, as a run the signal lands in does."""

    def __init__(self, signum: int, batch_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.signum, self.batch_size = signum, batch_size

    def forward(self, x):
        if x.shape[0] < self.batch_size and (not dist.is_initialized() or dist.get_world_size() == 1):
            if self.signum == signal.SIGINT:
                os.killpg(os.getpgid(the_command()), signal.SIGINT)
            else:
                os.kill(the_command(), signal.SIGTERM)
            time.sleep(5.0)
        return self.linear(x)


for name, signum in (("sigint", signal.SIGINT), ("sigterm", signal.SIGTERM)):
    ec.register_case(dataclasses.replace(
        ec.get_case("mlp"), name=f"interrupt_{name}", split=None, regimes=None,
        model=lambda signum=signum: Interrupting(signum, ec.get_case("mlp").batch_size),
    ))


class InterruptsItself(nn.Module):
    """A Ctrl-C that reaches an isolated run's child (a terminal signals the whole process group): the child must
    leave it to the command and train on, not raise KeyboardInterrupt inside the run."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.batch_size = batch_size

    def forward(self, x):
        if x.shape[0] < self.batch_size:
            os.kill(os.getpid(), signal.SIGINT)
        return self.linear(x)


ec.register_case(dataclasses.replace(ec.get_case("mlp"), name="interrupts_itself", split=None, regimes=None,
                                     model=lambda: InterruptsItself(ec.get_case("mlp").batch_size)))
