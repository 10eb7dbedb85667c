"""A team's own step on every rank of a process group: ``check_step(case, step, world_size=W)``.

The harness wraps the model in DistributedDataParallel and hands each rank's call of
``step(model, optimizer, (inputs, targets))`` that rank's contiguous shard of the global batch, as a
DistributedSampler would. Only plain data crosses to the worker ranks, so the step travels as the
import path of a module-level function (``module:function``), and the case must be registered.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

from .ddp_regimes import Distributed
from .errors import InvalidArgument
from .regimes import register_regime


def import_path(fn: Callable) -> str:
    """``module:qualname`` of ``fn``, checked to import back to ``fn`` in another process."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    path = f"{module}:{qualname}"
    try:
        found = module not in (None, "__main__") and "<" not in qualname and resolve(path) is fn
    except (ImportError, AttributeError):
        found = False
    if not found:
        raise InvalidArgument.value("step", fn, "a function defined at the top level of an importable module "
                                    "(worker processes import the step by name to run it on every rank)")
    return path


def resolve(path: str) -> Callable:
    module, _, qualname = path.partition(":")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


@register_regime
@dataclasses.dataclass(frozen=True)
class DdpStep(Distributed):
    name = "ddp_step"
    summary = "a team's own step function on every DDP rank, each given its shard of the global batch"
    fn: str = dataclasses.field(kw_only=True)  # module:function of the step

    def __post_init__(self) -> None:
        super().__post_init__()
        module, colon, function = self.fn.partition(":")
        if not (module and colon and function):
            raise InvalidArgument.value("fn", self.fn, "'module:function', the import path of a step function")

    def train_step(self, model, optimizer, batch, objective):
        mine = self.rank_shard(batch)
        loss = resolve(self.fn)(model, optimizer, (mine.inputs, mine.targets))
        if loss is None:
            return None
        # This rank's share of what the ranks' steps returned, averaged (the runner adds the shares up):
        # the global mean where shards hold equal item counts.
        return torch.as_tensor(float(loss), dtype=torch.float64) / self.world_size
