"""KempnerInstitute/KempnerForge#114: a resumed run restored AdamW with its moments reset to zero.

KempnerForge's ``CheckpointManager`` saved and loaded the optimizer through ``torch.distributed.checkpoint`` but
handed it the raw ``optimizer.state_dict()`` and gave the loaded dict back through ``optimizer.load_state_dict()``.
On resume the optimizer is built afresh, and AdamW creates its per-parameter state (``exp_avg``, ``exp_avg_sq``,
``step``) lazily at its first ``step()``: the fresh optimizer's ``state_dict()`` held no moment tensors, so
``dcp.load`` had nothing to fill, the saved moments were silently dropped and AdamW restarted from zero at every
resume. The report measured the model weights, the data position and the random state restored exactly (the first
resumed step's gradient norm matched the uninterrupted run's) and the update of that step differing. The fix (pull
#115) goes through DCP's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (and their model twins), whose
template allocates the moments in the right layout so that ``dcp.load`` fills them and the setter writes them back
into the live optimizer. Here 2 DDP ranks train mlp with AdamW, save after the first global batch and resume in
fresh processes.
"""

import dataclasses
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("KempnerInstitute/KempnerForge", "issue", 114, "resume",
          "DCP loaded the fresh optimizer's raw state_dict(), which holds no moments yet: AdamW reset on resume",
          fixed_by="pull #115", fix_acts="state")

ADAMW = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_kempnerforge_adamw",
    optimizer=lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    description="mlp trained with AdamW (lazily created moments), resumed after its first global batch"))


train_step = mean_loss_step  # each rank's mean loss over its equal shard; DDP averages the gradients over the ranks.


def _folder(folder):
    return os.path.join(folder, "step")


def save(model, optimizer, folder):
    """As fixed: the model and the optimizer through DCP's state-dict helpers."""
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=_folder(folder))


def load(model, optimizer, folder):
    """As fixed: the helpers' template holds the moments (allocated for the fresh optimizer), which DCP fills."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=_folder(folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def save_as_reported(model, optimizer, folder):
    """The raw state dicts, through DCP: the saved one holds the trained moments."""
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=_folder(folder))


def load_as_reported(model, optimizer, folder):
    """The fresh optimizer's raw state_dict() has an empty ``state``: DCP loads only the keys it is handed, so the
    moments in the checkpoint are never read, and ``load_state_dict`` restores the hyperparameters alone."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=_folder(folder))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def buggy():
    return ec.check_step(ADAMW, train_step, world_size=2,
                         resume=ec.Checkpoint(at=1, save=save_as_reported, load=load_as_reported))


def fixed():
    return ec.check_step(ADAMW, train_step, world_size=2, resume=ec.Checkpoint(at=1, save=save, load=load))
