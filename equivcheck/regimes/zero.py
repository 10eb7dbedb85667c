"""ZeRO stage 1: DDP with ``ZeroRedundancyOptimizer``, the optimizer state sharded over ranks.

DDP all-reduces the gradients as usual; each rank then steps only the parameters it owns, with the
case's own optimizer (same class, same hyperparameters), and broadcasts them to the others. The
arithmetic per parameter is the case optimizer's, so the run matches full batch up to rounding, while
each rank holds about 1/W of the optimizer state.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

from torch import nn
from torch.optim import Optimizer

from ..case import Case
from .ddp import Ddp


def sharded_like(optimizer: Optimizer) -> Optimizer:
    """``optimizer``'s class, parameter groups and hyperparameters, its state sharded by ZeRO."""
    # Imported here: torch.distributed.optim scripts its functional optimizers with torch.jit on import,
    # dozens of deprecation warnings that every importer of equivcheck would otherwise see.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [dict(group) for group in optimizer.param_groups]
    # The class's own keywords only: AdamW's defaults hold decoupled_weight_decay, which its __init__ refuses.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return with_step_hooks_of(optimizer, ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults))


def with_step_hooks_of(case_optimizer: Optimizer, made: Optimizer) -> Optimizer:
    """``made``, an optimizer built from the case's, with the step hooks the case's factory registered on it (clipping,
    warmup or an EMA run before or after each step): they would stay on an optimizer nobody steps. A hook ``made``
    holds already is not added twice."""
    if made is case_optimizer:
        return made
    held = {id(hook) for hooks in (made._optimizer_step_pre_hooks, made._optimizer_step_post_hooks)
            for hook in hooks.values()}
    for hooks, register in ((case_optimizer._optimizer_step_pre_hooks, made.register_step_pre_hook),
                            (case_optimizer._optimizer_step_post_hooks, made.register_step_post_hook)):
        for hook in list(hooks.values()):
            if id(hook) not in held:
                register(hook)
    return made


def local_part(optimizer: Optimizer) -> Optimizer:
    """The optimizer whose state this rank holds: a ZeroRedundancyOptimizer's local one (its shard), else
    ``optimizer`` itself (ZeRO's module is looked up, not imported: an optimizer of its class means it is loaded)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return optimizer.optim if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer


@dataclasses.dataclass(frozen=True)
class Zero(Ddp):
    name = "zero"
    summary = "DDP + ZeroRedundancyOptimizer: the case's optimizer, its state sharded over W ranks"

    def build_optimizer(self, case: Case, model: nn.Module) -> Optimizer:
        return sharded_like(case.build_optimizer(model))

    def local_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return local_part(optimizer)
