"""One bug planted in one place at a time, for saying where a run parts: the cases and the team steps live at this
module's top level, where the ranks import them by name."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

FULL_BATCH = 12  # the global batch: a module that sees fewer rows is in a micro-batch or on a rank


class TanhWithWrongGradient(torch.autograd.Function):
    """tanh whose backward is 1.5 x the true one: a wrong backward in a block's own code."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2) * 1.5


class CutScaledLinear(nn.Linear):
    """A layer with weights of its own whose forward is off by 1% where the rows are not the global batch's: a wrong
    forward inside a module that holds parameters (which FSDP2 shards, and a tensor-parallel plan would too)."""

    def forward(self, x):
        return super().forward(x) * (1.01 if x.shape[0] != FULL_BATCH else 1.0)


class Block(nn.Module):
    """A residual block whose own code (between its two layers) carries the bug, where the rows are not the global
    batch's: the reference trains right, a regime that cuts the batch does not."""

    def __init__(self, bug: str = "") -> None:
        super().__init__()
        self.fc1, self.bug = nn.Linear(8, 16), bug
        self.fc2 = CutScaledLinear(16, 8) if bug == "layer_forward" else nn.Linear(16, 8)

    def forward(self, x):
        cut = x.shape[0] != FULL_BATCH
        h = self.fc1(x)
        h = TanhWithWrongGradient.apply(h) if self.bug == "backward" and cut else torch.tanh(h)
        if self.bug == "forward" and cut:
            h = h * 1.01
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, bug: str = "") -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(), Block(bug), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        x = self.emb(ids).mean(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _case(bug: str, steps: int = 2) -> ec.Case:
    return ec.Case(name=f"located_{bug or 'clean'}", model=lambda: Net(bug),
                   data=lambda: (torch.randint(0, 10, (FULL_BATCH * steps, 5)),
                                 torch.randint(0, 4, (FULL_BATCH * steps,))),
                   loss=lambda out, target: F.cross_entropy(out, target, reduction="none"),
                   batch_size=FULL_BATCH, steps=steps)


CLEAN = _case("", steps=3)
FORWARD = _case("forward")
LAYER_FORWARD = _case("layer_forward")
BACKWARD = _case("backward")


def _loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def right_step(model, optimizer, batch):
    loss = _loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def stepped_twice_at_first(model, optimizer, batch):
    """The optimizer stepped twice on the first batch (a retry left in): one step more than the reference took."""
    loss = right_step(model, optimizer, batch)
    if not getattr(optimizer, "_stepped_before", False):
        optimizer._stepped_before = True
        loss = right_step(model, optimizer, batch)
    return loss


def decays_weights_after_the_step(model, optimizer, batch):
    """A weight decay of the team's own after optimizer.step(): its gradients are right, its update not."""
    loss = right_step(model, optimizer, batch)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.99)
    return loss


def halves_lr_after_each_step(model, optimizer, batch):
    """A schedule of the team's own that the reference does not have: the learning rate carried into the next step."""
    loss = right_step(model, optimizer, batch)
    for group in optimizer.param_groups:
        group["lr"] *= 0.5
    return loss


def scales_head_gradient(model, optimizer, batch):
    """The head's gradient scaled after backward, before the optimizer reads it (a hook meant for another model)."""
    loss = _loss(model, batch)
    loss.backward()
    model.head.weight.grad.mul_(2.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def head_left_out_of_all_reduce(model, optimizer, batch):
    """On ranks: backward without DDP's own sync, then every gradient all-reduced by hand but the head's."""
    inputs, targets = batch
    with model.no_sync():
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
    for name, parameter in model.module.named_parameters():
        if not name.startswith("head."):
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


_MEDDLED = []


def scales_head_gradient_once_per_process(model, optimizer, batch):
    """The head's gradient scaled on the first call this process makes, never again: state kept across runs, so a
    replay of the run trains right where the run did not."""
    loss = _loss(model, batch)
    loss.backward()
    if not _MEDDLED:
        _MEDDLED.append(True)
        model.head.weight.grad.mul_(2.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def restarts_the_random_stream(model, optimizer, batch):
    """A seed set inside the loop: every step's dropout draws from a stream restarted, the reference's runs on."""
    torch.manual_seed(7)
    return right_step(model, optimizer, batch)


def drops_a_quarter(model, optimizer, batch):
    """The dropout's rate read wrong (0.25 for 0.5): the same stream, other masks."""
    model[2].p = 0.25
    return right_step(model, optimizer, batch)
