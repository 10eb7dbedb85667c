"""TensorAuto/OpenTau#184: resuming from a checkpoint with bf16 Adam moments cast them to fp32, their rounding kept.

Before OpenTau pull #182 the training script cast the policy to bfloat16 and built ``torch.optim.AdamW`` over those
bf16 parameters (under DDP too, #176), so the checkpoints it wrote hold ``exp_avg`` and ``exp_avg_sq`` in bfloat16.
Pull #182 trains fp32 master parameters, whose AdamW state is fp32. Resuming a pre-#182 checkpoint with it raises
nothing: ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype, so the moments
arrive as fp32 tensors that hold only bfloat16's 8 significant bits, and the first steps after the resume run on
moments about 2**-9 away from the ones an uninterrupted fp32 run carries (the report: "slightly noisier moments
until fresh fp32 state accumulates"). The issue was closed as a note for users; no code recovers the lost bits, and
the remedy is a checkpoint written by the #182 code, whose moments are saved and loaded in their own precision.
Here 2 DDP ranks train mlp with AdamW in float64 (the fp32 masters' role) and resume after the first global batch.
As reported, the checkpoint holds the moments as the pre-#182 optimizer held them, in bfloat16, and the
optimizer's own ``load_state_dict`` brings them back up to the parameters' dtype; the resumed step's update parts
from the uninterrupted run's. As fixed the checkpoint keeps the moments as the optimizer holds them.
"""

import dataclasses
import os

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("TensorAuto/OpenTau", "issue", 184, "precision",
          "resume from a checkpoint with bf16 AdamW moments up-cast them to fp32 with bf16's rounding baked in",
          fixed_by="closed; a checkpoint from pull #182 on, its moments saved and loaded in their own precision",
          fix_acts="state")

ADAMW = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_opentau_adamw",
    optimizer=lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01),
    description="mlp trained with AdamW (its moments in the parameters' precision), resumed after its first batch"))

MOMENTS = ("exp_avg", "exp_avg_sq")
train_step = mean_loss_step


def _path(folder):
    return os.path.join(folder, f"opentau_rank{torch.distributed.get_rank()}.pt")


def save(model, optimizer, folder):
    """As fixed (#182 on): the model and the optimizer's state as they are."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, _path(folder))


def save_as_reported(model, optimizer, folder):
    """A pre-#182 checkpoint: the AdamW built over bf16 parameters held its moments in bfloat16, and saved them so."""
    state = optimizer.state_dict()
    for values in state["state"].values():
        for name in MOMENTS:
            values[name] = values[name].to(torch.bfloat16)
    torch.save({"model": model.state_dict(), "optimizer": state}, _path(folder))


def load(model, optimizer, folder):
    """Both: ``load_state_dict``, which casts each floating state tensor to its parameter's dtype."""
    checkpoint = torch.load(_path(folder), weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])


def buggy():
    return ec.check_step(ADAMW, train_step, world_size=2,
                         resume=ec.Checkpoint(at=1, save=save_as_reported, load=load))


def fixed():
    return ec.check_step(ADAMW, train_step, world_size=2, resume=ec.Checkpoint(at=1, save=save, load=load))
