"""NVIDIA/Megatron-LM#6859: the batch-invariant RMSNorm's backward multiplied the variance term by the weight twice.

Megatron Core's batch-invariant mode swaps the RMSNorm kernel for ``BatchInvariantRMSNormFn``, an autograd Function
whose forward computes ``x * rsigma * w`` in fp32 with a batch-invariant mean and whose backward is written by hand.
For ``y = x r w`` with ``r = (mean(x^2) + eps)^(-1/2)`` the input gradient is ``g w r - r^3 x s / D`` with
``s = sum(g x w)``, the weight already inside ``s``; the backward computed ``- w r^3 x s / D``, an extra elementwise
factor of the weight, so every layer below the norm trained on a wrong gradient while the forward, the loss and the
norm's own weight gradient were right. The pull (open) drops the extra factor (and makes the forward honour
``zero_centered_gamma``, off here). Here the team trains with batch-invariant mode on, accumulating 3 micro-batches
of every global batch (a batch-invariant model must train alike however the batch is split), held to one process
with Megatron's default RMSNorm; the model is a projection, the team's RMSNorm (weights away from 1) and a head.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("NVIDIA/Megatron-LM", "pull", 6859, "accumulation",
          "batch-invariant RMSNorm backward multiplied the variance term of dx by the weight twice",
          fixed_by="the pull's own change (open)", fix_acts="backward norm")

ACCUMULATION_STEPS = 3  # 12 samples a step: micro-batches of 4
MODE = {"batch_invariant": False, "weight_once": True}


class BatchInvariantRMSNormFn(torch.autograd.Function):
    """Megatron's batch-invariant RMSNorm on CPU: the forward in fp32 with rsigma saved, the backward by hand."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rsigma = torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rsigma)
        return x * rsigma * weight

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, rsigma = ctx.saved_tensors
        r3 = rsigma ** 3
        g_w = (grad_output * x * rsigma).sum(dim=tuple(range(grad_output.ndim - 1)))
        s = (grad_output * x * weight).sum(dim=-1, keepdim=True)
        variance_term = r3 if MODE["weight_once"] else weight * r3  # as reported: the weight a second time
        dx = grad_output * (weight * rsigma) - variance_term * (s * x) / x.shape[-1]
        return dx, g_w, None


class RMSNorm(nn.RMSNorm):
    """The team's norm: Megatron's default RMSNorm, or the batch-invariant kernel in batch-invariant mode."""

    def forward(self, x):
        if MODE["batch_invariant"]:
            return BatchInvariantRMSNormFn.apply(x, self.weight, self.eps)
        return super().forward(x)


class NormedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)
        self.norm = RMSNorm(8, eps=1e-6)
        self.head = nn.Linear(8, 3)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.proj(x))))


normed_head = ec.register_case(ec.Case(
    name="field_rms_normed_head", model=NormedHead,
    data=lambda: (torch.randn(36, 6), torch.randint(0, 3, (36,))),
    loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=12, steps=3,
    description="projection, RMSNorm (weights in [0.5, 1.5]), tanh, head over 3 classes"))


@contextlib.contextmanager
def batch_invariant_mode(weight_once):
    MODE.update(batch_invariant=True, weight_once=weight_once)
    try:
        yield
    finally:
        MODE.update(batch_invariant=False, weight_once=True)


def train_step(model, optimizer, batch, weight_once=True):
    """Batch-invariant mode on, each micro-batch's summed loss over the global batch's count, one step."""
    inputs, targets = batch
    with batch_invariant_mode(weight_once):
        for x, y in zip(inputs.chunk(ACCUMULATION_STEPS), targets.chunk(ACCUMULATION_STEPS)):
            (F.cross_entropy(model(x), y, reduction="sum") / len(inputs)).backward()
    optimizer.step()
    optimizer.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, weight_once=False)


def buggy():
    return ec.check_step("field_rms_normed_head", train_step_as_reported)


def fixed():
    return ec.check_step("field_rms_normed_head", train_step)
