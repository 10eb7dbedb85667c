"""deepspeedai/DeepSpeed#8438: under zero.Init no parameter was tagged for Muon, so ZeRO-3 trained all of them on Adam.

``set_optimizer_flags`` tags ``use_muon`` on a parameter with ``p.ndim >= 2`` (and no "embed" or "lm_head" in its name).
A model built under ``deepspeed.zero.Init`` has every partitioned parameter's data replaced by a flat ``(0,)``
placeholder, its layer's shape kept in ``ds_shape``, so every parameter read as 1-D, none was tagged, the engine built
``MuonWithAuxAdam`` with an Adam group alone, and ZeRO-3 found no sub-group using Muon. The pull measured a 2-layer
Llama: 14 parameters tagged and 84 ``muon_update`` calls over 6 steps when built normally, 0 and 0 under ``zero.Init``,
with the loss falling either way. The fix reads ``ds_shape`` where a parameter has one. The row builds the mlp case
"under zero.Init" on 2 DDP ranks: its wrap partitions each parameter into ZeRO-3's chunks, leaves the ``(0,)``
placeholder with ``ds_shape`` while the flags are set, then restores the whole weights (ZeRO-3's gathering around each
forward is no part of this bug), and trains with ``_muon.Stage3`` at one micro-batch a step.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import MLP, Stage3, chunk_of, set_optimizer_flags

BUG = Bug("deepspeedai/DeepSpeed", "pull", 8438, "optimizer",
          "under zero.Init every param read as 1-D (0,) placeholder: none tagged use_muon, all trained on Adam",
          fix_acts="optimizer")


def built_under_zero_init(model, reads_ds_shape):
    """deepspeed.initialize on a model built under zero.Init: each parameter's chunk kept (``ds_tensor``), its data a
    ``(0,)`` placeholder with the layer's shape in ``ds_shape`` while the optimizer flags are set; then the weights
    whole again (what GatheredParameters would hand back)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    whole = {}
    for p in model.parameters():
        whole[p] = p.data
        p.ds_shape, p.ds_numel, p.ds_tensor = p.shape, p.numel(), chunk_of(p.data, world, rank)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    set_optimizer_flags(model, shape=(lambda p: getattr(p, "ds_shape", p.shape)) if reads_ds_shape else
                        (lambda p: p.shape))
    for p, data in whole.items():
        p.data = data
    return model


def zero_init(model):
    return DistributedDataParallel(built_under_zero_init(model, reads_ds_shape=True))


def zero_init_as_reported(model):
    return DistributedDataParallel(built_under_zero_init(model, reads_ds_shape=False))


def zero3(optimizer):
    """ZeRO-3 around the MuonWithAuxAdam the engine built from the flags, Muon in the step (as pull #8600 has it: at
    one micro-batch a step the reduce path of the time made the same update)."""
    return Stage3(optimizer, muon_in_reduce=False)


def train_step(model, optimizer, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.reduce_partition(0)
    optimizer.full_grads()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def buggy():
    return ec.check_step(MLP, train_step, world_size=2, wrap=zero_init_as_reported, optimizer_wrap=zero3)


def fixed():
    return ec.check_step(MLP, train_step, world_size=2, wrap=zero_init, optimizer_wrap=zero3)
