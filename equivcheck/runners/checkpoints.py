"""A run's checkpoint, as a careful team writes it, for a resume (:mod:`equivcheck.regimes.resume`): the model and the
optimizer through ``torch.distributed.checkpoint`` (each rank writes its shards; the ranks that load read the shards
they hold now, so a checkpoint saved on 4 ranks loads on 2), and each rank's own file of what DCP does not hold: the
random state and the GradScaler's. A part the resume's regime leaves out (a pitfall) is neither saved nor restored.
The case's learning-rate scheduler is the case's, not the code checked: it goes in those files with a team's own
checkpoint code too.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..process.import_paths import resolve
from ..regimes.resume import RANK_ZERO_OPTIMIZER
from .request import Checkpointed


def save(restart: Checkpointed, assembled, scaler) -> None:
    """The checkpoint of a trained segment (``assembled``: train.Assembled): a team's own save where it gave one,
    handed what its step is handed (the module the regime drives, the optimizer), else the careful one below."""
    if restart.save:
        resolve(restart.save)(assembled.module, assembled.optimizer, restart.folder)
        torch.save(_scheduler_state(restart, assembled), _own_file(restart, _rank()))
        return
    import torch.distributed.checkpoint as dcp  # imported by the first resume, not by ``import equivcheck``

    model, optimizer = assembled.model, assembled.optimizer
    dcp.save(_sharded_state(restart, model, optimizer), checkpoint_id=_shards(restart))
    if _whole_optimizer_file(restart, optimizer):
        if "optimizer" in restart.parts:  # ZeRO's shards gathered on rank 0, as its own documentation asks
            optimizer.consolidate_state_dict(to=0)
        if _rank() == 0:
            torch.save(optimizer.state_dict(), _optimizer_file(restart))
    own = _scheduler_state(restart, assembled)
    if "rng" in restart.parts:
        own["rng"] = torch.default_generator.get_state()
        if torch.cuda.is_initialized():
            own["cuda_rng"] = torch.cuda.get_rng_state_all()
    if "scaler" in restart.parts:
        own["scaler"] = scaler.state_dict()
    torch.save(own, _own_file(restart, _rank()))


def restore(restart: Checkpointed, assembled, scaler) -> None:
    """Into a model and an optimizer built anew: a team's own load where it gave one, else the shards this rank holds
    now, then its own file (rank 0's where the checkpoint was saved on fewer ranks: every rank is seeded alike, so
    their random states agree)."""
    if restart.load:
        resolve(restart.load)(assembled.module, assembled.optimizer, restart.folder)
    else:
        _restore_sharded(restart, assembled)
    mine = _own_file(restart, _rank())
    own = torch.load(mine if os.path.exists(mine) else _own_file(restart, 0), weights_only=False)
    if "scheduler" in own:
        assembled.scheduler.load_state_dict(own["scheduler"])
    if "rng" in own:
        torch.default_generator.set_state(own["rng"])
        if "cuda_rng" in own and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(own["cuda_rng"])
    if "scaler" in own:
        scaler.load_state_dict(own["scaler"])


def _restore_sharded(restart: Checkpointed, assembled) -> None:
    """The model's and the optimizer's shards this rank holds now, from the careful checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optimizer = assembled.model, assembled.optimizer
    whole = os.path.exists(_optimizer_file(restart))  # as it was saved: ZeRO's (or the pitfall's) one file
    state = _sharded_state(restart, model, optimizer, whole)  # the template DCP loads this rank's shards into
    dcp.load(state, checkpoint_id=_shards(restart))
    set_model_state_dict(model, state["model"])
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if whole:  # every rank takes its part of rank 0's file (all of it, where its optimizer is whole)
        optimizer.load_state_dict(torch.load(_optimizer_file(restart), weights_only=False))


def _scheduler_state(restart: Checkpointed, assembled) -> dict:
    """The case's scheduler's state, where it has one and the checkpoint holds it."""
    if assembled.scheduler is None or "scheduler" not in restart.parts:
        return {}
    return {"scheduler": assembled.scheduler.state_dict()}


def _zero(optimizer) -> bool:
    """ZeroRedundancyOptimizer, whose state torch.distributed.checkpoint's helpers do not take."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _whole_optimizer_file(restart: Checkpointed, optimizer) -> bool:
    """Whether the optimizer goes through one file rank 0 writes: ZeRO's consolidated state, or the pitfall's."""
    return RANK_ZERO_OPTIMIZER in restart.parts or ("optimizer" in restart.parts and _zero(optimizer))


def _optimizer_file(restart: Checkpointed) -> str:
    return os.path.join(restart.folder, "optimizer.pt")


def _sharded_state(restart: Checkpointed, model, optimizer, whole: bool = False) -> dict:
    """What torch.distributed.checkpoint holds of the careful checkpoint, as this rank has it: the model's state and,
    where the checkpoint saves it through DCP (not ZeRO's, nor one ``whole`` file), the optimizer's."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if "optimizer" in restart.parts and not whole and not _zero(optimizer):
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def _shards(restart: Checkpointed) -> str:
    return os.path.join(restart.folder, "shards")


def _own_file(restart: Checkpointed, rank: int) -> str:
    return os.path.join(restart.folder, f"rank{rank}.pt")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
