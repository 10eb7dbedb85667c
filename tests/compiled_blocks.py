"""A team's FSDP2 with each block compiled and registered in its own place, as torchtitan does, imported by name on
the ranks (tests/test_compiled.py): the compiled blocks hold the case's parameters under ``_orig_mod.`` names."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    for name, block in list(model.named_children()):
        if any(True for _ in block.parameters()):
            compiled = torch.compile(block, backend="aot_eager")
            model.register_module(name, compiled)
            fully_shard(compiled, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def step(model, optimizer, batch):
    """Faithful: each rank's loss sum over the global batch's samples (FSDP2 averages over the ranks)."""
    inputs, targets = batch
    optimizer.zero_grad()
    losses = F.cross_entropy(model(inputs), targets, reduction="none")
    (losses.sum() * dist.get_world_size() / (len(inputs) * dist.get_world_size())).backward()
    optimizer.step()
    return losses.mean().detach()


def step_scaled_by_world(model, optimizer, batch):
    """The bug: the loss multiplied by the world size once more."""
    inputs, targets = batch
    optimizer.zero_grad()
    losses = F.cross_entropy(model(inputs), targets, reduction="none")
    (losses.mean() * dist.get_world_size()).backward()
    optimizer.step()
    return losses.mean().detach()
