"""Where a run parts is said only from what was seen (issue 65): a module the team's step swaps in is traced by the
place it holds; a module's own code is claimed only where every child of it both runs called was compared; a child the
run never recorded (never called as a module) is named as unseen instead of being counted among those that compute
alike."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ScaledTanh(nn.Module):
    """The team's own activation: 1% off."""

    def forward(self, x):
        return torch.tanh(x) * 1.01


CASE = ec.Case(name="seen_blocks", model=Net, data=lambda: (torch.randn(24, 6), torch.randint(0, 3, (24,))),
               loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=12, steps=2)


def full_batch(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()


def swaps_the_activation(model, optimizer, batch):
    """Replaces blocks.1's activation with another module object at its first call."""
    if not isinstance(model.blocks[1].act, ScaledTanh):
        model.blocks[1].act = ScaledTanh()
    full_batch(model, optimizer, batch)


def patches_the_activation(model, optimizer, batch):
    """The same change made on the module that is there: its forward replaced."""
    act = model.blocks[1].act
    if not hasattr(act, "patched"):
        act.patched, act.forward = True, lambda x: torch.tanh(x) * 1.01
    full_batch(model, optimizer, batch)


pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def test_a_module_patched_in_place_is_located_in_it():
    (outcome,) = ec.check_step(CASE, patches_the_activation).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()


def test_a_module_the_step_swaps_in_is_traced_by_its_place_and_located_there():
    (outcome,) = ec.check_step(CASE, swaps_the_activation).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()


class KeywordBlock(Block):
    def forward(self, x):
        return x + self.fc2(self.act(input=self.fc1(x)))


class KeywordNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([KeywordBlock(), KeywordBlock()])


class ScaledTanhOfInput(nn.Module):
    def forward(self, input):
        return torch.tanh(input) * 1.01


def swaps_the_keyword_activation(model, optimizer, batch):
    if not isinstance(model.blocks[1].act, ScaledTanhOfInput):
        model.blocks[1].act = ScaledTanhOfInput()
    full_batch(model, optimizer, batch)


def test_a_module_swapped_in_before_the_forward_has_its_keyword_inputs_seen_from_its_first_call():
    case = ec.Case(name="seen_keywords", model=KeywordNet, data=CASE.data, loss=CASE.loss, batch_size=12, steps=2)
    (outcome,) = ec.check_step(case, swaps_the_keyword_activation).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()


def inlines_the_activation(model, optimizer, batch):
    """blocks.1 computes its activation itself (1% off), never calling its ``act`` module."""
    block = model.blocks[1]
    if "forward" not in vars(block):
        block.forward = lambda x: x + block.fc2(torch.tanh(block.fc1(x)) * 1.01)
    full_batch(model, optimizer, batch)


def test_a_child_the_run_never_called_is_named_unseen_and_its_parents_own_code_is_not_claimed():
    (outcome,) = ec.check_step(CASE, inlines_the_activation).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1"), outcome.describe()
    assert not location.own_code, location.matched
    assert "`blocks.1.act` not recorded in the run" in location.matched, location.matched
    assert "its own code is not claimed" in location.matched
    assert "`blocks.1.fc1`" in location.matched.split("compute alike")[0]  # what was seen alike is still said
    assert "eager twin" not in location.matched  # nothing compiled: its eager twin, replayed, reads what it read


class ScaledBlock(Block):
    def forward(self, x):
        return super().forward(x) * 1.01


def swaps_a_block(model, optimizer, batch):
    """Replaces the whole of blocks.1 (an item of a ModuleList, which is never called) at its first call."""
    if not isinstance(model.blocks[1], ScaledBlock):
        swapped = ScaledBlock()
        swapped.load_state_dict(model.blocks[1].state_dict())
        model.blocks[1] = swapped
        optimizer.param_groups[0]["params"] = list(model.parameters())
    full_batch(model, optimizer, batch)


def test_a_module_lists_item_swapped_in_is_traced_with_its_children_by_their_places():
    (outcome,) = ec.check_step(CASE, swaps_a_block).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1"), outcome.describe()
    assert location.own_code, location.matched
    assert "its children (`blocks.1.act`, `blocks.1.fc1`, `blocks.1.fc2`) compute alike" in location.matched


class Gate(nn.Module):
    """Scales its input by its call count: a non-persistent buffer its forward moves (no checkpoint of
    ``state_dict()`` holds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            self.calls += 1
        return x * (1 + 0.1 * self.calls)


class GatedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return super().forward(self.gate(x))


GATED = ec.Case(name="seen_gated", model=GatedNet, data=lambda: (torch.randn(36, 6), torch.randint(0, 3, (36,))),
                loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=12, steps=3)


def loses_the_buffer_at_step_2(model, optimizer, batch):
    """As a resume from ``model.state_dict()`` at step 2 does: the call count starts again from 0."""
    model.steps_taken = getattr(model, "steps_taken", 0) + 1
    if model.steps_taken == 3:
        model.gate.calls.zero_()
    full_batch(model, optimizer, batch)


def test_a_buffer_the_step_began_with_otherwise_is_state_in_its_module_not_its_forward():
    (outcome,) = ec.check_step(GATED, loses_the_buffer_at_step_2).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (2, "state", "gate"), outcome.describe()
    assert location.tensor == "buffer 'gate.calls' as the step began"
    assert "BatchNorm" not in outcome.describe() and "a resume whose checkpoint left them out" in outcome.comparison.hint
    assert ec.check_step(GATED, full_batch).outcomes[0].verdict is ec.Verdict.EQUIVALENT  # the twin: kept, it holds


def ddp_step(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()  # each rank's mean: DDP averages over the equal shards
    optimizer.step()


def swap_on_ranks(model, activation):
    """blocks.1's activation replaced with an ``activation()`` at its first call, on each rank (the DDP wrapper's)."""
    if not isinstance(model.module.blocks[1].act, activation):
        model.module.blocks[1].act = activation()


def swaps_the_activation_on_ranks(model, optimizer, batch):
    """As swaps_the_activation, on each rank, through the DDP wrapper."""
    swap_on_ranks(model, ScaledTanh)
    ddp_step(model, optimizer, batch)


def test_a_module_swapped_in_on_ddp_ranks_is_traced_by_its_place_and_located_there():
    (outcome,) = ec.check_step(CASE, swaps_the_activation_on_ranks, world_size=2).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()
    assert ec.check_step(CASE, ddp_step, world_size=2).outcomes[0].verdict is ec.Verdict.EQUIVALENT


class HeadInTheLoss(torch.autograd.Function):
    """A fused linear cross entropy: the head's weight and the hidden states go in, the head module is never called;
    ``off`` scales the weight's gradient it hands back (1: exact)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, off):
        with torch.enable_grad():
            hidden, weight, bias = (t.detach().requires_grad_() for t in (hidden, weight, bias))
            loss = F.cross_entropy(F.linear(hidden, weight, bias), targets)
            grads = torch.autograd.grad(loss, (hidden, weight, bias))
        ctx.save_for_backward(grads[0], grads[1] * off, grads[2])
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):
        return *(grad * grad_output for grad in ctx.saved_tensors), None, None


def fused_loss(model, optimizer, batch, off=1.0):
    inputs, targets = batch
    optimizer.zero_grad()
    hidden = inputs
    for block in model.blocks:
        hidden = block(hidden)
    loss = HeadInTheLoss.apply(hidden, model.head.weight, model.head.bias, targets, off)
    loss.backward()
    optimizer.step()
    return loss.detach()


def fused_loss_off(model, optimizer, batch):
    return fused_loss(model, optimizer, batch, off=1.001)


def test_a_parameter_read_outside_its_never_called_module_is_located_in_that_module_with_no_hint():
    """The run never calls ``head``; its weight's gradient, made by the fused loss, is where backward parts. Before,
    nothing was said, and the hint named a detach between per-token backward calls the step never made."""
    (outcome,) = ec.check_step(CASE, fused_loss_off).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "backward", "head"), outcome.describe()
    assert location.tensor == "the gradient backward delivered to 'head.weight'"
    assert "the run never called `head`" in location.matched and not outcome.comparison.hint
    assert ec.check_step(CASE, fused_loss).outcomes[0].verdict is ec.Verdict.EQUIVALENT  # the twin: exact, it holds
