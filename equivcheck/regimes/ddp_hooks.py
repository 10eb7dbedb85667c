"""DDP with a gradient-compressing communication hook: lossy by design, so each is compared at its own
error bound, which every report names, and never at the precision's tolerance alone.

``ddp_hook:world_size=W,hook=fp16`` all-reduces every bucket in float16 (torch's ``fp16_compress_hook``:
cast, divide by W, sum, cast back); ``hook=bf16`` in bfloat16 (``bf16_compress_hook``). The error of one
element of the averaged gradient, with u the 16-bit type's unit roundoff (2^-11 for float16, 2^-8 for
bfloat16), is at most (W + 1) u times the mean of the ranks' magnitudes: one rounding when each rank casts
its part, one when it divides by W (none for a power of two, counted anyway), W - 1 in the sum. Where the
ranks' parts agree in sign that is (W + 1) u relative to the gradient itself, the ``rtol``; where they cancel
the error stays at the scale of the parts, so the bound has an absolute term as well: (W + 1) u for parts
of order one (the precision modes' convention, see ``precision.py``), plus float16's subnormal spacing
(2^-24) per rank, below which float16 keeps nothing. These add to the case's or precision's own tolerance
(the reordering error every regime may carry). The bound is a step's; weights carry the steps' errors
on (times the learning rate), well inside it on the built-in cases (docs/parallel.md has the margins).

``hook=powersgd`` (``powerSGD_hook`` with ``PowerSGDState``) replaces each large enough gradient matrix by a
rank-``approximation_rank`` approximation and feeds the approximation's error into the next step: its
error is not bounded element by element (it depends on the gradient's spectrum, and error feedback moves
it between steps), so no tolerance could say "equivalent" of it honestly. PowerSGD all-reduces plainly
before step ``start_iter`` (torch's ``start_powerSGD_iter``, 1000 by default): a case whose steps all come
before it is compared at the precision's own tolerance, which proves the hook in place and exact; where
compression starts within the case's steps, the comparison stays at that tolerance too and reports the
error measured, a mismatch (the twin that proves the compression happens).
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..case import Case
from ..device import DEFAULT_DEVICE, gpus
from ..errors import InvalidArgument, expect_int
from ..measure.collectives import attach_counter
from ..precision import Precision, Tolerance
from .base import CommunicationCounter, Pitfall, reduced_in
from .ddp import Ddp, DdpMeanLoss

TORCH_HOOKS = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook"}
HOOKS = tuple(TORCH_HOOKS)
POWERSGD_DEFAULTS = {"approximation_rank": 1, "start_iter": 1000}


@dataclasses.dataclass(frozen=True)
class DdpHook(Ddp):
    name = "ddp_hook"
    summary = ("ddp with a compressing comm hook (hook=fp16, bf16 or powersgd), compared at the "
               "compression's own error bound")

    hook: str = dataclasses.field(kw_only=True, metadata={"example": "fp16"})  # no default: a spec names its hook
    approximation_rank: int = POWERSGD_DEFAULTS["approximation_rank"]  # powersgd only: the rank of each approximation
    start_iter: int = POWERSGD_DEFAULTS["start_iter"]  # powersgd only: plain all-reduce before this step

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hook not in HOOKS:
            raise InvalidArgument.value("hook", self.hook, f"one of {', '.join(HOOKS)}")
        expect_int("approximation_rank", self.approximation_rank)
        expect_int("start_iter", self.start_iter, minimum=2)  # PowerSGDState's own floor with error feedback
        if self.hook != "powersgd":
            for option, default in POWERSGD_DEFAULTS.items():
                if getattr(self, option) != default:
                    raise InvalidArgument.value(option, getattr(self, option), f"{default} (the default) with "
                                                f"hook={self.hook}: only hook=powersgd takes it")

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        if self.hook == "powersgd" and not self.placement(device).on_gpus and gpus() > 0:
            return ("torch's powerSGD_hook calls torch.cuda.synchronize(device) on its gradients' device wherever CUDA "
                    "is available (powerSGD_hook.py), which raises for ranks on the CPU beside a GPU: it needs nccl with "
                    f"a CUDA device per rank ({self.world_size} asked, {gpus()} found, device={device!r})")
        return super().unavailable(device)

    def count_communication(self, module: nn.Module) -> CommunicationCounter:
        """DDP takes one comm hook per wrapper: the counter's, which counts and then calls this regime's."""
        return attach_counter(module, self.comm_hook)

    def comm_hook(self, process_group):
        """This regime's (state, hook) for one DDP wrapper in ``process_group``: torch's own hooks."""
        if self.hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group, matrix_approximation_rank=self.approximation_rank,
                                                start_powerSGD_iter=self.start_iter, random_seed=0)
            return state, powerSGD_hook.powerSGD_hook
        return process_group, getattr(default_hooks, TORCH_HOOKS[self.hook])

    def tolerance_for(self, case: Case, precision: Precision, base: Tolerance) -> Tolerance:
        hook = f"{TORCH_HOOKS[self.hook]} over {self.world_size} ranks"
        if self.hook == "powersgd":
            when = (f"plain all-reduce before step {self.start_iter}, so all {case.steps} steps of {case.name}"
                    if self.start_iter >= case.steps else f"compressing from step {self.start_iter}")
            return dataclasses.replace(base, source=(
                f"{hook}, rank {self.approximation_rank}, {when}: not bounded element-wise, so "
                f"compared at {precision.name}'s own tolerance"))
        return reduced_in(self.hook, self.world_size, precision, base, hook)


@dataclasses.dataclass(frozen=True)
class DdpHookMeanLoss(DdpHook):
    name = "ddp_hook_mean_loss"
    summary = "PITFALL: ddp_mean_loss under a compressing comm hook: each rank's *mean* loss, wrong on uneven shards"
    pitfall = Pitfall("per-rank mean loss under DDP (token or shard imbalance)", twin="ddp_hook")

    train_step = DdpMeanLoss.train_step
