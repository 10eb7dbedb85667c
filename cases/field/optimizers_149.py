"""facebookresearch/optimizers#149: Shampoo skipped a rank's whole step when it held no gradient, its count fell behind.

DistributedShampoo's ``step`` checked each param group's gradients on this rank and ``continue``d when there were none,
before ``state_lists[STEP].add_(1)`` and before ``Distributor.update_params()``. Under the FSDP distributors each rank
steps the shards it holds, so a rank whose shards got no gradient in a step (a conditionally active layer off for the
batch) kept its step count while every other rank advanced: its later steps computed the preconditioners at other steps
(``step % precondition_frequency``, ``start_preconditioning_step``) and corrected the grafting's bias by another count
than one process would. The DDP and HSDP distributors hung instead, in an all-gather the rank never joined. The fix
(reported by wz337, landed from the internal diff D73223132) removes the skip, so every rank counts every step, and
guards the ``torch._foreach_*`` calls against empty lists. The row's model routes each sample to one of two experts by
the sign of its first feature, and the second global batch sends none to expert 1; on 2 gloo ranks each rank steps the
parameters its FSDP shard holds (rank 1 expert 1's) with a cut-down Shampoo (factor matrices, root inverses every 2
steps from step 2, Adam grafting), and each parameter is broadcast from its holder after the step: rank 1 enters the
third step one count behind.
"""

import dataclasses
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("facebookresearch/optimizers", "pull", 149, "optimizer",
          "Shampoo skipped a rank's step when it held no gradient: its step count fell behind the others'",
          fix_acts="optimizer experts.1")

LR, BETA2, EPSILON, GRAFTING_EPSILON = 0.01, 0.999, 1e-6, 1e-8
PRECONDITION_FREQUENCY, START_PRECONDITIONING_STEP = 2, 2


class RoutedExperts(nn.Module):
    """An embedding, two experts chosen per sample by the sign of its first feature, and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        routed = torch.zeros_like(h)
        for index, chosen in enumerate((x[:, 0] <= 0, x[:, 0] > 0)):
            rows = chosen.nonzero().squeeze(1)
            if rows.numel():  # an expert no sample chose takes no part in the step: no gradient
                routed = routed.index_put((rows,), self.experts[index](h[rows]))
        return self.head(h + routed)


def data():
    """The mlp's shapes; the second global batch (samples 12-23) routes nothing to expert 1, and each rank's half of
    the first and third routes samples to both experts."""
    inputs, targets = torch.randn(36, 6), torch.randint(0, 3, (36,))
    inputs[12:24, 0] = -inputs[12:24, 0].abs()
    for first in (0, 6, 24, 30):
        inputs[first, 0], inputs[first + 1, 0] = inputs[first, 0].abs() + 0.1, -inputs[first + 1, 0].abs() - 0.1
    return inputs, targets


def root_inverse(factor, root):
    eigenvalues, eigenvectors = torch.linalg.eigh(factor + EPSILON * torch.eye(len(factor), dtype=factor.dtype))
    return eigenvectors @ torch.diag(eigenvalues.clamp_min(EPSILON) ** (-1 / root)) @ eigenvectors.T


class DistributedShampoo(torch.optim.Optimizer):
    """DistributedShampoo cut down: a step count per param group; per tensor one factor matrix per dimension (an
    exponential moving average of the gradient's contractions, bias-corrected), their inverse roots recomputed at
    ``start_preconditioning_step`` and every ``precondition_frequency`` steps after it, and Adam grafting (the
    preconditioned direction scaled to Adam's norm; Adam's direction alone before preconditioning starts). On ranks,
    the FSDP distributor: each rank steps the tensors its shard holds (``holders``) and each tensor is then broadcast
    from its holder. ``skips_without_grads``: a group with no gradient on this rank skipped, step count and all."""

    def __init__(self, named, skips_without_grads=False):
        named = list(named)
        super().__init__([p for _, p in named], dict(lr=LR))
        self.skips_without_grads = skips_without_grads
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.holders = {p: (1 if "experts.1" in name else 0) % ranks for name, p in named}

    def _holds(self, p):
        return not dist.is_initialized() or self.holders[p] == dist.get_rank()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p for p in group["params"] if self._holds(p) and p.grad is not None]
            if self.skips_without_grads and not grads:
                continue
            group["step"] = step = group.get("step", 0) + 1
            amortized = (step % PRECONDITION_FREQUENCY == 0 and step > START_PRECONDITIONING_STEP
                         or step == START_PRECONDITIONING_STEP)
            for p in grads:
                grad, state = p.grad, self.state[p]
                if not state:
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["factors"] = [torch.zeros(n, n, dtype=p.dtype) for n in p.shape]
                    state["inverse_roots"] = [torch.eye(n, dtype=p.dtype) for n in p.shape]
                state["exp_avg_sq"].mul_(BETA2).addcmul_(grad, grad, value=1 - BETA2)
                graft = grad / ((state["exp_avg_sq"] / (1 - BETA2 ** step)).sqrt() + GRAFTING_EPSILON)
                for dim, factor in enumerate(state["factors"]):
                    moved = grad.movedim(dim, 0).reshape(grad.shape[dim], -1)
                    factor.mul_(BETA2).add_(moved @ moved.T, alpha=1 - BETA2)
                    if amortized:
                        state["inverse_roots"][dim] = root_inverse(factor / (1 - BETA2 ** step), 2 * grad.ndim)
                if step < START_PRECONDITIONING_STEP:
                    direction = graft
                else:
                    direction = grad
                    for dim, inverse_root in enumerate(state["inverse_roots"]):
                        direction = torch.tensordot(direction, inverse_root, dims=([0], [0]))  # cycles the dims
                    direction = direction * (graft.norm() / direction.norm().clamp_min(EPSILON))
                p.add_(direction, alpha=-group["lr"])
        if dist.is_initialized():
            for p in self.holders:  # FSDP's all-gather before the next forward: each tensor from its holder
                dist.broadcast(p.data, src=self.holders[p])


def shampoo(parameters):
    return DistributedShampoo(parameters.model.named_parameters())


def shampoo_as_reported(parameters):
    return DistributedShampoo(parameters.model.named_parameters(), skips_without_grads=True)


CASE = ec.register_case(ec.Case(
    name="field_shampoo_routed_experts", model=RoutedExperts, data=data,
    loss=partial(F.cross_entropy, reduction="none"), batch_size=12, steps=3, optimizer=shampoo, regimes=("full_batch",),
    description="two experts routed by a feature's sign, under a cut-down DistributedShampoo"))
CASE_AS_REPORTED = ec.register_case(dataclasses.replace(
    CASE, name="field_shampoo_routed_experts_as_reported", optimizer=shampoo_as_reported,
    description="the same under the DistributedShampoo that skipped a rank's step without gradients"))


def shard_by_holder(model, mesh):
    """The team's parallelize: every rank keeps the whole model; its optimizer steps the tensors its shard holds."""
    return model


def train_step(model, optimizer, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    for p in model.parameters():  # the gradient reduction: an expert no rank used has no gradient anywhere
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def buggy():
    return ec.check_step(CASE_AS_REPORTED, train_step, mesh={"dp": 2}, parallelize=shard_by_holder)


def fixed():
    return ec.check_step(CASE, train_step, mesh={"dp": 2}, parallelize=shard_by_holder)
