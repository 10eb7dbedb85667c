"""ByteDance-Seed/VeOmni#1059: with Ulysses SP and dp_size 1, DDP's all-reduce was a no-op: SP ranks' grads never met.

VeOmni's DDP path wrapped the model with ``process_group=dp_group``. Ulysses sequence parallelism shrinks the
data-parallel size to ``world_size / sp_size``, and the sequence dimension lives on a mesh dimension of its own,
outside ``dp_group``; with ``sp_size == world_size`` the group holds one rank and DDP's all-reduce does nothing,
while each rank's gradient comes from its own ``1 / sp_size`` slice of the sequence. The optimizer stepped on that
partial gradient, silently, on every rank (FSDP2 was unaffected: it reduces over ``fsdp_group``, the flattened
``dp x sp`` group). The fix the issue lays out (pull #1086 closed it) averages every gradient over ``fsdp_group``
in ``veomni_clip_grad_norm`` when the mode is DDP and ``sp_size > 1``, before clipping. Here the team's model is a
per-token block (the attention and its all-to-alls are left out: every token's output depends on that token alone),
2 ranks split each sequence in half, each takes the mean loss of its half, and DDP wraps the model over the
data-parallel group of one rank.
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import token_mean

BUG = Bug("ByteDance-Seed/VeOmni", "issue", 1059, "ddp",
          "Ulysses SP with dp_size 1: DDP over dp_group (one rank) never reduced the SP ranks' grads",
          fixed_by="pull #1086", fix_acts="communication")

GROUPS = {}


def parallelize(model, mesh):
    """VeOmni's DDP branch: the model in DDP over ``dp_group`` (one rank here); ``fsdp_group`` is dp x sp."""
    GROUPS["sp"], GROUPS["fsdp"] = mesh["cp"].get_group(), dist.group.WORLD
    return DistributedDataParallel(model, process_group=mesh["dp"].get_group())


def clip_grad_norm(model, sync_over_sp=True):
    """``veomni_clip_grad_norm``'s sync, as fixed: under DDP with SP, every gradient averaged over ``fsdp_group``
    (no clipping at stake here)."""
    if sync_over_sp:
        size = dist.get_world_size(GROUPS["fsdp"])
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad, group=GROUPS["fsdp"])
            parameter.grad.div_(size)


def train_step(model, optimizer, batch, sync_over_sp=True):
    """This rank's half of every sequence (Ulysses' split), the mean loss over its tokens."""
    inputs, targets = batch
    size, rank = dist.get_world_size(GROUPS["sp"]), dist.get_rank(GROUPS["sp"])
    inputs, targets = inputs.chunk(size, dim=1)[rank], targets.chunk(size, dim=1)[rank]
    loss = token_mean(model(inputs), targets)
    loss.backward()
    clip_grad_norm(model, sync_over_sp)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, sync_over_sp=False)


def buggy():
    return ec.check_step("field_tiny_gpt", train_step_as_reported, mesh={"cp": 2}, parallelize=parallelize)


def fixed():
    return ec.check_step("field_tiny_gpt", train_step, mesh={"cp": 2}, parallelize=parallelize)
