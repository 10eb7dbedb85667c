"""Only what was seen is said on DDP ranks too (issue 65): a buffer a rank's resume lost is `state` in its module, a
child no rank called as a module is named unseen, a difference under the verdict's tolerance is located where it
begins at float64's noise floor, and a block changed in a DDP model the step compiles is located in it; each beside
its twin on the same ranks, equivalent."""

import weakref

import pytest
import torch

import equivcheck as ec

from test_locate_below_tolerance import CASE as HAIR_OFF, TanhAHairOff
from test_locate_seen import CASE, GATED, ScaledTanh, ddp_step, swap_on_ranks

pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def loses_the_buffer_at_step_2_on_ranks(model, optimizer, batch):
    """Each rank resumes at step 2 from ``state_dict()``: the gate's call count starts again from 0."""
    net = model.module
    net.steps_taken = getattr(net, "steps_taken", 0) + 1
    if net.steps_taken == 3:
        net.gate.calls.zero_()
    ddp_step(model, optimizer, batch)


def inlines_the_activation_on_ranks(model, optimizer, batch):
    """blocks.1 computes its activation itself (1% off) on every rank, never calling its ``act`` module."""
    block = model.module.blocks[1]
    if "forward" not in vars(block):
        block.forward = lambda x: x + block.fc2(torch.tanh(block.fc1(x)) * 1.01)
    ddp_step(model, optimizer, batch)


def swaps_in_the_approximation_on_ranks(model, optimizer, batch):
    swap_on_ranks(model, TanhAHairOff)
    ddp_step(model, optimizer, batch)


def test_a_buffer_a_ranks_resume_lost_is_state_in_its_module():
    (outcome,) = ec.check_step(GATED, loses_the_buffer_at_step_2_on_ranks, world_size=2).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (2, "state", "gate"), outcome.describe()
    assert location.tensor == "buffer 'gate.calls' as the step began"
    assert ec.check_step(GATED, ddp_step, world_size=2).outcomes[0].verdict is ec.Verdict.EQUIVALENT  # the twin


def test_a_child_no_rank_called_is_named_unseen_and_its_parents_own_code_is_not_claimed():
    (outcome,) = ec.check_step(CASE, inlines_the_activation_on_ranks, world_size=2).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1"), outcome.describe()
    assert not location.own_code and "`blocks.1.act` not recorded in the run" in location.matched


def test_a_difference_under_the_tolerance_on_ranks_is_located_where_it_begins():
    (outcome,) = ec.check_step(HAIR_OFF, swaps_in_the_approximation_on_ranks, world_size=2).outcomes
    location = outcome.location
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()
    assert location.below_tolerance and "under the verdict's tolerance" in location.matched
    assert ec.check_step(HAIR_OFF, ddp_step, world_size=2).outcomes[0].verdict is ec.Verdict.EQUIVALENT  # the twin


COMPILED = weakref.WeakKeyDictionary()  # each rank's compiled DDP model, made at its first step


def compiled_ddp_step(model, optimizer, batch):
    if optimizer not in COMPILED:
        torch._dynamo.reset()
        COMPILED[optimizer] = torch.compile(model, backend="aot_eager")
    ddp_step(COMPILED[optimizer], optimizer, batch)


def compiles_with_another_activation_on_ranks(model, optimizer, batch):
    swap_on_ranks(model, ScaledTanh)
    compiled_ddp_step(model, optimizer, batch)


@pytest.mark.full_only  # make test-full: two compiled checks on ranks (12 s); in process, tests/test_locate_compiled.py
def test_a_compiled_ddp_model_with_a_changed_block_is_located_in_that_block():
    (outcome,) = ec.check_step(CASE, compiles_with_another_activation_on_ranks, world_size=2).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()
    assert ec.check_step(CASE, compiled_ddp_step, world_size=2).outcomes[0].verdict is ec.Verdict.EQUIVALENT



def zero_scaling_the_gradients_from_its_second_step(optimizer):
    """The team's ZeRO stage 1, whose step scales the gradients it was handed by 1.5 from its second step on."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class Scaling(ZeroRedundancyOptimizer):
        def step(self, closure=None, **kwargs):
            self.taken = getattr(self, "taken", 0) + 1
            if self.taken > 1:
                for group in self.param_groups:
                    for p in group["params"]:
                        p.grad.mul_(1.5)
            return super().step(closure, **kwargs)

    return Scaling(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer), **optimizer.defaults)


def test_a_sharded_optimizers_state_is_read_from_the_rank_that_holds_it_not_claimed_missing():
    """ZeRO keeps each parameter's momentum in its owner's local optimizer alone (the wrapper's own ``state`` stays
    empty). Read from the wrapper, every state looked missing; read from rank 0 only, the state of each parameter rank 1
    owns did: either way this update fault at step 1 was located at `state` (in `0`, then in `1.norm`)."""
    from test_team_parallel import train_step

    (outcome,) = ec.check_step("block_stack", train_step, world_size=2,
                               optimizer_wrap=zero_scaling_the_gradients_from_its_second_step).outcomes
    location = outcome.location
    assert outcome.verdict is ec.Verdict.MISMATCH and (location.step, location.phase) == (1, "optimizer"), \
        outcome.describe()
