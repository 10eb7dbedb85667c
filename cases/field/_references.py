"""References the field's modules share: the training a reported step must equal, where plain full batch is not it."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def clipped_once(max_norm, mean_loss=F.cross_entropy):
    """A team that clips is held to one process taking the global batch's mean loss (``mean_loss(output, targets)``)
    and clipping its whole gradient once, to ``max_norm``, before the step: what its code means, however it splits the
    batch or shards the model. Bind the step at a module's top level (``clipped_full_batch = clipped_once(0.1)``)."""

    def clipped_full_batch(model, optimizer, batch):
        inputs, targets = batch
        loss = mean_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return clipped_full_batch


def mean_loss_step(model, optimizer, batch):
    """A plain step: the mean loss over the batch it is handed (a rank's equal shard, whose gradients DDP or FSDP2
    averages), one backward, one optimizer step."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def mesh_where(model, shape=None, names=None):
    """The device mesh a team builds for ``model`` where the model lives (its ranks' device: the CPU under gloo), over
    every rank unless ``shape`` says otherwise: FSDP2's own default picks CUDA wherever CUDA exists, and would move
    the model of a gloo rank away from its batch."""
    return init_device_mesh(next(model.parameters()).device.type, shape or (dist.get_world_size(),),
                            mesh_dim_names=names)


def fully_sharded(model):
    """A team's FSDP2 wrap: every top-level layer with parameters, then the root, over all ranks."""
    mesh = mesh_where(model)
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)
