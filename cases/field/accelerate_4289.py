"""huggingface/accelerate#4289: with FSDP2 and fp16, load_state() stepped the GradScaler it had just restored.

``Accelerator.load_state()`` under FSDP2 loaded the optimizer through torch's DCP helpers
(``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) handing them accelerate's ``AcceleratedOptimizer``
wrapper. To materialize a fresh optimizer's empty state those helpers call ``optimizer.step()`` once on zero gradients
(``_init_optim_state``), and through the wrapper that dummy step ran ``scaler.step()`` and ``scaler.update()``: the
scaler, restored just before (and lazily initialized for that dummy step with the private
``_lazy_init_scale_growth_tracker``), came out changed. The report's numbers: saved ``scale 1024, _growth_tracker 1``
(growth_interval 2), after ``load_state`` ``scale 2048, _growth_tracker 0``; loading in a process whose scaler was
already initialized failed an assert instead. The fixes proposed (pulls #4290 and #4291, open when this row was
written) hand DCP the unwrapped ``torch.optim.Optimizer``, so the dummy step cannot reach the scaler. Here 2 ranks
shard mlp with FSDP2 and step through a scaled-down ``AcceleratedOptimizer`` with a GradScaler (init scale 1024,
growth interval 2), saved after one global batch and resumed in fresh processes, exactly the report's states. The
row is a known miss: the restored scale is doubled, and the run trains on the same numbers.
"""

import os
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import fully_sharded

BUG = Bug("huggingface/accelerate", "issue", 4289, "resume",
          "FSDP2 + fp16 load_state: DCP's dummy optimizer step went through the wrapper and stepped the scaler",
          known_miss="reproduced (the restored scaler comes out with scale 2048 and growth tracker 0 where 1024 and 1 "
                     "were saved, the report's numbers), not caught: a loss scale that is a power of two is undone "
                     "exactly when the gradients are unscaled, so every gradient, weight and loss equals the "
                     "uninterrupted run's until a step's scaled gradients overflow at the doubled scale and it is "
                     "skipped. equivcheck compares gradients, weights and losses; it would need the GradScaler's "
                     "state compared as part of the run, or an fp16 run that overflows at the doubled scale",
          fix_acts="state")

SCALER = {"init_scale": 1024.0, "growth_interval": 2}


shard_every_layer = fully_sharded  # FSDP2: each layer with parameters, then the root


class AcceleratedOptimizer(torch.optim.Optimizer):
    """accelerate's wrapper, scaled down: with a scaler, ``step`` is ``scaler.step`` then ``scaler.update``."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self.scaler.step(self.optimizer, closure)
        self.scaler.update()


PREPARED = weakref.WeakKeyDictionary()  # accelerator.prepare's wrapper of each run's optimizer


def prepared(optimizer):
    if optimizer not in PREPARED:
        PREPARED[optimizer] = AcceleratedOptimizer(optimizer, torch.amp.GradScaler("cpu", **SCALER))
    return PREPARED[optimizer]


def train_step(model, optimizer, batch):
    """accelerator.backward (the loss scaled) and the wrapper's step; the loss is the rank's sum over the global
    sample count, times the world size (FSDP2 averages the gradients over the ranks)."""
    accelerated = prepared(optimizer)
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    loss = F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / samples
    accelerated.scaler.scale(loss).backward()
    accelerated.step()
    accelerated.zero_grad()
    return loss.detach()


def _folder(folder):
    return os.path.join(folder, "checkpoint")


def save(model, optimizer, folder):
    """save_state: the model and the optimizer through DCP, the scaler in its own file."""
    accelerated = prepared(optimizer)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=_folder(folder))
    torch.save(accelerated.scaler.state_dict(), os.path.join(folder, f"scaler{dist.get_rank()}.pt"))


def _load(model, optimizer, folder, hands_dcp_the_wrapper):
    accelerated = prepared(optimizer)
    accelerated.scaler.load_state_dict(torch.load(os.path.join(folder, f"scaler{dist.get_rank()}.pt")))
    for_dcp = optimizer
    if hands_dcp_the_wrapper:
        accelerated.scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))  # the stale workaround
        for_dcp = accelerated
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, for_dcp)}
    dcp.load(state, checkpoint_id=_folder(folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, for_dcp, state["optimizer"])


def load(model, optimizer, folder):
    """As fixed (pull #4291): DCP is handed the unwrapped optimizer; the scaler is restored and left alone."""
    _load(model, optimizer, folder, hands_dcp_the_wrapper=False)


def load_as_reported(model, optimizer, folder):
    _load(model, optimizer, folder, hands_dcp_the_wrapper=True)


def buggy():
    return ec.check_step("mlp", train_step, world_size=2, wrap=shard_every_layer,
                         resume=ec.Checkpoint(at=1, save=save, load=load_as_reported))


def fixed():
    return ec.check_step("mlp", train_step, world_size=2, wrap=shard_every_layer,
                         resume=ec.Checkpoint(at=1, save=save, load=load))
