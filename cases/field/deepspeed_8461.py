"""deepspeedai/DeepSpeed#8461: under BF16_Optimizer, Muon's flat partitions were stepped with no Newton-Schulz at all.

bf16 with ``grad_accum_dtype: fp32`` at ZeRO stage 1 selects ``BF16_Optimizer``, which replaces each param group's
parameters by a flat fp32 partition, as the ZeRO optimizers do. ``MuonWithAuxAdam.step`` reads a flat (1-D) parameter as
a ZeRO partition whose gradient already holds the orthogonalised update; but the ZeRO optimizers apply ``muon_update``
while they fill the partition and ``BF16_Optimizer`` never does, so the Muon group's step was plain SGD on the averaged
gradient, with no error (pull #8442's survey of the wrappers: ``s1-bf16-ga32``, Newton-Schulz calls 0). #8442 made
DeepSpeed refuse the combination and this issue records what lifting the refusal takes; pull #8526 lifts it: after the
gradients are reduced it runs ``muon_update`` on the original matrices, its momentum partitioned like the master weights
and gathered for the update, and copies each rank's own slice into the partition's update. The row trains the mlp case
on 2 DDP ranks with ``BF16_Optimizer``'s flat partitions written in plain PyTorch around DeepSpeed's
``MuonWithAuxAdam``, in float64 (bf16 itself plays no part).
"""

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import MLP, Wrapping, all_gather_flat, flat_layout, muon_update
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("deepspeedai/DeepSpeed", "issue", 8461, "optimizer",
          "BF16_Optimizer's flat partitions read as 'Muon applied already': the Muon group stepped as SGD",
          fixed_by="pull #8526", fix_acts="optimizer")


class BF16Optimizer(Wrapping):
    """BF16_Optimizer's partitions around the MuonWithAuxAdam it is given: each group flattened, padded and cut over
    the ranks (``fp32_groups_flat_partition``), the reduced gradient's slice handed to the optimizer as the
    partition's; ``applies_muon``: pull #8526's Muon updates on the whole matrices first."""

    def __init__(self, optimizer, applies_muon):
        super().__init__(optimizer)
        self.applies_muon = applies_muon
        self.layout = flat_layout(self.groups, self.world)
        self.fp32 = [self._partition(i, [p.detach() for p in params]) for i, params in enumerate(self.groups)]
        self.momentum = [torch.zeros_like(flat) for flat in self.fp32]  # partitioned like the master weights

    def _flat(self, i, tensors):
        size, _ = self.layout[i]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(size * self.world - flat.numel())])

    def _partition(self, i, tensors):
        size, _ = self.layout[i]
        return self._flat(i, tensors)[self.rank * size:(self.rank + 1) * size].clone()

    def _muon_updates(self, i):
        """muon_update on each whole matrix of group ``i``, the group's momentum gathered as workspace and this rank's
        slice of it kept."""
        size, offsets = self.layout[i]
        momentum = all_gather_flat(self.momentum[i])
        updates = []
        for p, offset in zip(self.groups[i], offsets):
            buffer = momentum[offset:offset + p.numel()].view(p.shape)
            updates.append(muon_update(p.grad.clone(), buffer, self.beta))
        self.momentum[i] = momentum[self.rank * size:(self.rank + 1) * size].clone()
        return updates

    @torch.no_grad()
    def step(self, closure=None):
        for i, params in enumerate(self.groups):
            grads = self._muon_updates(i) if self.applies_muon and self.uses_muon[i] else [p.grad for p in params]
            self.fp32[i].grad = self._partition(i, grads)
        self.step_partitions(self.fp32)
        for i, params in enumerate(self.groups):
            flat, start = all_gather_flat(self.fp32[i]), 0
            for p in params:
                p.copy_(flat[start:start + p.numel()].view(p.shape))
                start += p.numel()
            self.fp32[i].grad = None


def bf16_optimizer(optimizer):
    return BF16Optimizer(optimizer, applies_muon=True)


def bf16_optimizer_as_reported(optimizer):
    return BF16Optimizer(optimizer, applies_muon=False)


train_step = mean_loss_step  # each rank's mean loss over its equal shard; the all-reduce averages the gradients


def buggy():
    return ec.check_step(MLP, train_step, world_size=2, optimizer_wrap=bf16_optimizer_as_reported)


def fixed():
    return ec.check_step(MLP, train_step, world_size=2, optimizer_wrap=bf16_optimizer)
