"""A team's own step, checked as the team runs it: under FSDP2 (their own fully_shard wrap) and under DDP
with find_unused_parameters=True; each beside the bug the gate must catch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import equivcheck as ec


# The team's wrap takes fully_shard's default mesh, which puts every rank on a GPU where there is one.
DEFAULT_MESH_FITS = pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason=(
    "fully_shard's default mesh puts every rank on a GPU where CUDA exists: 2 ranks need 2 GPUs, and this "
    "machine has 1 (without CUDA the ranks shard on the CPU)"))


def shard_every_block(model):
    """The team's FSDP2 wrap: every top-level block, then the root."""
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block)
    return fully_shard(model)


def train_step(model, optimizer, batch):
    """This rank's loss sum over the global sample count, times the world size: the ranks' average is the
    global mean, which both DDP and FSDP2 compute by averaging the ranks' gradients."""
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    loss = F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / samples
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_forgetting_the_world_size(model, optimizer, batch):
    """Wrong: the sum over the global count, not times the world size; the averaged gradient is 1/W too small."""
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    (F.cross_entropy(model(inputs), targets, reduction="sum") / samples).backward()
    optimizer.step()
    optimizer.zero_grad()


@DEFAULT_MESH_FITS
def test_our_step_under_fsdp2_matches_full_batch(equivcheck):
    equivcheck.check_step("block_stack", train_step, world_size=2, wrap=shard_every_block)


@DEFAULT_MESH_FITS
def test_the_gate_catches_our_bug_under_fsdp2():
    report = ec.check_step("block_stack", train_step_forgetting_the_world_size, world_size=2, wrap=shard_every_block)
    (outcome,) = report.outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.comparison.margin > 100
    # FSDP2 reduce-scattered once per sharded block per step: 5 blocks hold parameters.
    assert outcome.result.syncs == (5, 5, 5) and outcome.result.sync_wrappers == 5


def test_our_step_under_ddp_with_find_unused_parameters_matches_full_batch(equivcheck):
    equivcheck.check_step("unused_branch", train_step, world_size=2, ddp_options={"find_unused_parameters": True})


def test_the_gate_catches_our_bug_under_ddp_with_find_unused_parameters():
    report = ec.check_step("unused_branch", train_step_forgetting_the_world_size, world_size=2,
                           ddp_options={"find_unused_parameters": True})
    assert report.outcomes[0].verdict is ec.Verdict.MISMATCH and report.outcomes[0].comparison.margin > 100


def test_without_find_unused_parameters_ddp_itself_refuses_the_unused_branch():
    (outcome,) = ec.check_step("unused_branch", train_step, world_size=2).outcomes
    assert outcome.verdict is ec.Verdict.ERROR and "find_unused_parameters" in outcome.reason


def test_unknown_ddp_options_are_named_with_the_allowed_ones():
    with pytest.raises(ec.InvalidArgument, match="'find_unused' is not allowed: expected DistributedDataParallel "
                                                 "options among gradient_as_bucket_view, bucket_cap_mb, static_graph"):
        ec.check_step("unused_branch", train_step, world_size=2, ddp_options={"find_unused": True})
    with pytest.raises(ec.InvalidArgument, match="ddp_options=.* is not allowed without world_size"):
        ec.check_step("unused_branch", train_step, ddp_options={"static_graph": True})
