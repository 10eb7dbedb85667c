"""deepspeedai/DeepSpeed#8141: ZeRO-1/2's reduce-scatter left a split Muon matrix half unreduced on each owner.

With ``reduce_scatter`` (the default) ZeRO-1/2 average each gradient bucket and copy each averaged slice back only to
the rank whose flat partition holds it. Muon then runs ``muon_update`` on each whole matrix of the partition in
``get_flat_partition`` and keeps the rank's slice of the result. A matrix that crosses a partition boundary is whole on
no rank: each owner orthogonalised its own reduced slice joined to its local, unreduced share of the others' slices, and
the owners applied inconsistent updates (#7807; #8090 had refused the combination). The pull copies each reduced slice
of a Muon matrix that spans several partitions to every rank that owns part of it, so they all orthogonalise the same
reduced matrix; parameters inside one partition keep the owner-only copy. The row trains the mlp case under DeepSpeed's
``MuonWithAuxAdam`` on 2 DDP ranks, ZeRO-2's copy rule as DDP's comm hook and its flat partitions written in plain
PyTorch around the optimizer: the Muon group's 90 elements are cut 45 and 45, so ``0.weight`` (60) is split and
``2.weight`` is rank 1's alone.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import MLP, Wrapping, all_gather_flat, flat_layout, muon_groups, muon_update

BUG = Bug("deepspeedai/DeepSpeed", "pull", 8141, "optimizer",
          "ZeRO-1/2 reduce-scatter: Newton-Schulz on a split matrix joining reduced and unreduced slices",
          fix_acts="optimizer 0")


def owned(p, size, offset, rank):
    """The elements of ``p`` (at ``offset`` in its group's flat tensor) that rank ``rank``'s partition holds."""
    return slice(min(max(rank * size - offset, 0), p.numel()), min(max((rank + 1) * size - offset, 0), p.numel()))


def note_partitions(model):
    """Mark each parameter with the ranks whose flat partition holds part of it, and the part this rank holds: the
    engine's groups (the flags set as deepspeed.initialize sets them), flattened and cut as ZeRO-1/2 cut them."""
    groups = muon_groups(list(model.parameters()), model)
    world, rank = dist.get_world_size(), dist.get_rank()
    for group, (size, offsets) in zip(groups, flat_layout([g["params"] for g in groups], world)):
        for p, offset in zip(group["params"], offsets):
            p.zero_owners = set(range(offset // size, (offset + p.numel() - 1) // size + 1))
            p.zero_mine = owned(p, size, offset, rank)


def allreduce_and_scatter(copies_to_every_owner, bucket):
    """The bucket's gradients averaged and all-reduced, each reduced slice copied back only to the ranks it is for:
    the rest of this rank's bucket keeps its own, unreduced gradient divided by the ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    averaged = bucket.buffer() / world
    reduced = averaged.clone()
    dist.all_reduce(reduced)
    start = 0
    for p in bucket.parameters():
        split_muon = p.use_muon and len(p.zero_owners) > 1
        if copies_to_every_owner and split_muon:
            copy = slice(0, p.numel()) if rank in p.zero_owners else slice(0, 0)
        else:
            copy = p.zero_mine
        averaged[start + copy.start:start + copy.stop] = reduced[start + copy.start:start + copy.stop]
        start += p.numel()
    future = torch.futures.Future()
    future.set_result(averaged)
    return future


def reduce_scatter(model):
    """The team's ZeRO-2 gradient path, as fixed: DDP's buckets reduced by DeepSpeed's copy rule (pull #8141)."""
    note_partitions(model)
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(True, allreduce_and_scatter)
    return wrapped


def reduce_scatter_as_reported(model):
    note_partitions(model)
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(False, allreduce_and_scatter)
    return wrapped


class ZeroOneTwo(Wrapping):
    """DeepSpeedZeroOptimizer (stage 2) around the MuonWithAuxAdam it is given: each group's flat fp32 partition,
    and ``get_flat_partition`` as DeepSpeed wrote it (each whole Muon matrix of the partition through
    ``muon_update``, then this rank's slice)."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.layout = flat_layout(self.groups, self.world)
        self.fp32 = [self._partition(i, [p.detach() for p in params]) for i, params in enumerate(self.groups)]
        self.momentum = {}  # the momentum of each Muon matrix in this rank's partition, whole
        self.grads = {}  # each parameter of this rank's partition: its gradient as the reduce left it

    def _partition(self, i, tensors):
        """This rank's slice of group ``i``'s flattened ``tensors``, zero-padded."""
        size, _ = self.layout[i]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flat = torch.cat([flat, flat.new_zeros(size * self.world - flat.numel())])
        return flat[self.rank * size:(self.rank + 1) * size].clone()

    def take_grads(self):
        """After the reduce: a parameter of this rank's partition keeps its gradient; another's is cleared."""
        for p in (p for group in self.groups for p in group):
            if self.rank in p.zero_owners:
                self.grads[p] = p.grad.detach().clone()
            p.grad = None

    def full_grads(self):
        """safe_get_full_grad of every parameter: the reduced slices, each from the rank that holds it."""
        for p in (p for group in self.groups for p in group):
            whole = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            if p in self.grads:
                whole[p.zero_mine] = self.grads[p].reshape(-1)[p.zero_mine]
            dist.all_reduce(whole)
            p.grad = whole.view(p.shape)

    def get_flat_partition(self, i):
        tensors = []
        for p in self.groups[i]:
            grad = self.grads.get(p)
            if grad is None:
                grad = torch.zeros_like(p)  # not this rank's: its slice leaves it out
            elif self.uses_muon[i]:
                grad = muon_update(grad.clone(), self.momentum.setdefault(p, torch.zeros_like(p)), self.beta)
            tensors.append(grad)
        return self._partition(i, tensors)

    @torch.no_grad()
    def step(self, closure=None):
        for i in range(len(self.groups)):
            self.fp32[i].grad = self.get_flat_partition(i)
        self.step_partitions(self.fp32)
        for i, group in enumerate(self.groups):  # every rank's updated partition into the parameters
            flat = all_gather_flat(self.fp32[i])
            start = 0
            for p in group:
                p.copy_(flat[start:start + p.numel()].view(p.shape))
                start += p.numel()
            self.fp32[i].grad = None
        self.grads.clear()


def zero2(optimizer):
    return ZeroOneTwo(optimizer)


def train_step(model, optimizer, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.take_grads()
    optimizer.full_grads()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def buggy():
    return ec.check_step(MLP, train_step, world_size=2, wrap=reduce_scatter_as_reported, optimizer_wrap=zero2)


def fixed():
    return ec.check_step(MLP, train_step, world_size=2, wrap=reduce_scatter, optimizer_wrap=zero2)
