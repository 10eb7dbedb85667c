"""pytorch/pytorch#115710: the sharded grad scaler copied found_inf back before its async all-reduce had finished.

FSDP's ``ShardedGradScaler`` checks each rank's gradient shards for infs and NaNs in ``unscale_`` and must then
agree across the ranks: one overflow anywhere means every rank skips the step and backs off its scale. With CPU
offload the gradients, and so ``found_inf``, live on the CPU; the scaler moved ``found_inf`` to the GPU, started an
asynchronous all-reduce on that copy, copied the copy back into the CPU tensor at once, and only then waited on
the futures. The copy back ran before the reduction had landed, so each rank kept its own finding: when rank 0's
shard overflowed and the other ranks' did not, rank 0 skipped the step and halved its scale while the others
stepped their shards, and the replicas trained apart. The pull (landed) keeps the device copies, waits on every
future, and copies the reduced values back after. Here the scaler's path is written out in plain PyTorch on 2 DDP
ranks: the model is one FSDP unit, each rank checks its shard of the flat gradient (an overflow being a scaled
gradient that float16 cannot hold), and the step goes to a fused AdamW, which GradScaler hands ``found_inf`` and
which leaves everything as it was where it is set, against the same step in one process. The scale starts at 2**20,
where the first step overflows on rank 1's shard (the output layer's) and not on rank 0's (the first layer's). The
copy back before the wait reads the value the reduction started from, as the CUDA streams gave it (on gloo the read
would race the reduction). As reported rank 0 steps where one process skips, and the replicas part from the first
step; as fixed every rank skips it.
"""

import dataclasses
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "pull", 115710, "precision",
          "sharded grad scaler copied found_inf before waiting on its async all-reduce: ranks skipped apart",
          fix_acts="optimizer")

INIT_SCALE = 2.0 ** 20


def distributed():
    return dist.is_available() and dist.is_initialized()


class ShardedGradScaler:
    """The parts of ``torch.distributed.fsdp.ShardedGradScaler`` a step goes through: ``scale``, ``unscale_`` (this
    rank's shard checked, ``found_inf`` synchronised over the ranks), ``step`` (no update on an overflow) and
    ``update`` (backoff on an overflow, growth after ``growth_interval`` clean steps). ``copy_after_wait``: the fix
    (wait on the all-reduce, then copy); else the copy back before the wait."""

    def __init__(self, init_scale=INIT_SCALE, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 copy_after_wait=True):
        self.scale_ = torch.tensor(init_scale, dtype=torch.float64)
        self.growth_tracker = 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.copy_after_wait = copy_after_wait
        self.found_inf = None

    def scale(self, loss):
        return loss * self.scale_

    def unscale_(self, optimizer):
        inv_scale = 1.0 / self.scale_
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
        found_inf = torch.zeros((), dtype=torch.float64)  # on the CPU: the gradients are offloaded
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # FSDP1's flat parameter: the model is one unit
        shard = flat.tensor_split(world)[rank]  # this rank's shard of it, what FSDP hands its optimizer
        if not torch.isfinite(shard.to(torch.float16)).all():  # a scaled gradient float16 cannot hold
            found_inf.fill_(1.0)
        for g in grads:
            g.mul_(inv_scale)
        if distributed():
            self.synchronise(found_inf)
        self.found_inf = found_inf

    def synchronise(self, found_inf):
        found_inf_on_device = found_inf.clone()  # found_inf.cuda()
        unreduced = found_inf_on_device.clone()  # what a copy queued before the reduction lands reads
        future = dist.all_reduce(found_inf_on_device, async_op=True).get_future()
        if not self.copy_after_wait:
            found_inf.copy_(unreduced)  # as reported: v.copy_(v_on_cuda.cpu()), then the wait
        torch.futures.wait_all([future])
        if self.copy_after_wait:
            found_inf.copy_(found_inf_on_device)  # the fix: the reduced value, once the future is done

    def step(self, optimizer):
        """``GradScaler.step`` for an optimizer that takes the scaling itself (``_step_supports_amp_scaling``: a
        fused AdamW) after ``unscale_``: the optimizer is handed ``found_inf`` and always steps, and its kernel
        leaves the parameters and the state as they were wherever ``found_inf`` is set."""
        optimizer.grad_scale = None  # unscaled already
        optimizer.found_inf = self.found_inf.to(torch.float32)
        optimizer.step()

    def update(self):
        if self.found_inf.item():
            self.scale_ *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale_ *= self.growth_factor
                self.growth_tracker = 0


_SCALERS = weakref.WeakKeyDictionary()


def train_step(model, optimizer, batch, copy_after_wait=True):
    """The team's step: the loss scaled, backward, the scaler's step and update. The scaler lives as long as the
    optimizer it scales for (one per run, as a training script makes one beside its optimizer)."""
    if optimizer not in _SCALERS:
        _SCALERS[optimizer] = ShardedGradScaler(copy_after_wait=copy_after_wait)
    scaler = _SCALERS[optimizer]
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, copy_after_wait=False)


MLP = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_pytorch_sharded_scaler",
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    description="mlp under a fused AdamW, through a sharded grad scaler starting at 2**20"))


def buggy():
    return ec.check_step(MLP, train_step_as_reported, reference=train_step, world_size=2)


def fixed():
    return ec.check_step(MLP, train_step, reference=train_step, world_size=2)
