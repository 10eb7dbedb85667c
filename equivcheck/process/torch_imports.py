"""FSDP2 from torch, imported on first use and in one place.

``torch.distributed.fsdp`` pulls in DTensor, about half a second that every ``import equivcheck`` would
otherwise pay, so nothing imports it before an FSDP2 regime runs or a module is asked whether it is an FSDP
module (none can be before FSDP2 itself is imported). On a torch without FSDP2 (or without its custom
collectives) those regimes are skipped with the reason and everything else runs.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types

import torch
from torch import nn

from ..errors import Unavailable


# What a first run imports lazily (creating an optimizer imports torch._dynamo, and with it sympy: about a
# second here). A process that forks runs or ranks imports it once, before forking, so no child pays it again.
TRAINING_IMPORTS = ("torch._dynamo",)


@functools.cache
def import_what_training_imports() -> None:
    for module in TRAINING_IMPORTS:
        importlib.import_module(module)


@functools.cache
def fsdp2() -> types.SimpleNamespace:
    """``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy`` and the collective classes that counting wraps; raises
    :class:`Unavailable` with the reason where this torch lacks them."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError as error:
        raise Unavailable(f"FSDP2 regimes need fully_shard with custom collectives, which torch "
                          f"{torch.__version__} lacks ({error})") from error
    return types.SimpleNamespace(FSDPModule=FSDPModule, fully_shard=fully_shard,
                                 MixedPrecisionPolicy=MixedPrecisionPolicy, DefaultAllGather=DefaultAllGather,
                                 DefaultReduceScatter=DefaultReduceScatter)


def fsdp2_missing() -> str | None:
    """Why this torch cannot run FSDP2 regimes, or None."""
    try:
        fsdp2()
    except Unavailable as why:
        return str(why)
    return None


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by ``fully_shard``, without importing FSDP2 where nothing has."""
    return "torch.distributed.fsdp" in sys.modules and fsdp2_missing() is None and isinstance(module, fsdp2().FSDPModule)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters), without importing DTensor: none can
    exist before its module is imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)
