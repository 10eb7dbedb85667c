"""The parts of torch.distributed that arrived in later torch releases than the oldest equivcheck
installs with, imported in one place: where one is missing, the regimes that need it are skipped with
the reason, and everything else runs (``import equivcheck`` never fails on an older torch)."""

from __future__ import annotations

import torch

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    # FSDP2's collectives as classes: counting them means wrapping them (set_custom_reduce_scatter).
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    FSDP2_MISSING: str | None = None
except ImportError as error:  # pragma: no cover - the pinned torch has them
    class FSDPModule:  # type: ignore[no-redef]
        """Stands in where torch has no FSDP2: no module is an instance of it."""

    fully_shard = None  # type: ignore[assignment]
    DefaultAllGather = DefaultReduceScatter = object  # type: ignore[assignment,misc]
    FSDP2_MISSING = (f"FSDP2 regimes need fully_shard with custom collectives, which torch {torch.__version__} "
                     f"lacks ({error})")
