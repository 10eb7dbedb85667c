"""A team's own step, checked as the team runs it: under FSDP2 (their own fully_shard wrap), under DDP
with find_unused_parameters=True and under ZeRO (their own ZeroRedundancyOptimizer); each beside the bug the
gate must catch."""

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


def rank_loss(model, batch):
    """This rank's loss sum over the global sample count, times the world size: the ranks' average is the
    global mean, which DDP, FSDP2 and ZeRO (DDP underneath) compute by averaging the ranks' gradients."""
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    return F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / samples


def train_step(model, optimizer, batch):
    loss = rank_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_forgetting_zero_grad(model, optimizer, batch):
    """Wrong: the gradients are never cleared, so every step adds the previous steps' gradients up."""
    loss = rank_loss(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_loop(model, optimizer, batches):
    return [train_step(model, optimizer, batch) for batch in batches]


def zero(optimizer):
    """The team's ZeRO stage 1: the optimizer they were given, its state sharded over the ranks."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # scripts optimizers with torch.jit on import

    return ZeroRedundancyOptimizer(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer),
                                   **optimizer.defaults)


def zero_with_the_learning_rate_only(optimizer):
    """Wrong: rebuilt with the learning rate alone, so SGD's momentum (0.9 in the case) falls back to 0."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer),
                                   lr=optimizer.defaults["lr"])


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


@pytest.fixture(scope="module")
def under_zero():
    return ec.check_step("block_stack", train_step, world_size=2, optimizer_wrap=zero)


def test_our_step_under_zero_matches_full_batch(under_zero):
    (outcome,) = under_zero.outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2
    parameters = list(ec.get_case("block_stack").model().double().parameters())
    whole = sum(p.numel() * p.element_size() for p in parameters)
    # DDP's bucket and our one-sample-count all-reduce (a float64 scalar), then ZeRO's broadcast of every tensor
    assert outcome.result.collectives == ({"all_reduce": (2, whole + 8), "broadcast": (len(parameters), whole)},) * 3
    params, grads, state = outcome.result.state_bytes  # each rank holds about half of SGD's momentum buffers
    assert params == grads == whole and 0.45 <= state / whole <= 0.55, outcome.result.state_bytes


def test_our_loop_under_zero_matches_full_batch(equivcheck):
    equivcheck.check_loop("block_stack", train_loop, world_size=2, optimizer_wrap=zero)


@pytest.mark.parametrize(("step", "optimizer_wrap"), [(train_step, zero_with_the_learning_rate_only),
                                                      (train_step_forgetting_zero_grad, zero)])
def test_the_gate_catches_our_bugs_under_zero(step, optimizer_wrap):
    (outcome,) = ec.check_step("block_stack", step, world_size=2, optimizer_wrap=optimizer_wrap).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.comparison.margin > 100, outcome.describe()


def not_an_optimizer(optimizer):
    return optimizer.param_groups


def test_bad_optimizer_wraps_are_named():
    with pytest.raises(ec.InvalidArgument, match="optimizer_wrap=.* is not allowed without world_size: expected "
                                                 "world_size= with it"):
        ec.check_step("block_stack", train_step, optimizer_wrap=zero)
    with pytest.raises(ec.InvalidArgument, match="optimizer_wrap=.*lambda.* expected a function, or an object bound "
                                                 "to a name, at the top level of an importable module"):
        ec.check_step("block_stack", train_step, world_size=2, optimizer_wrap=lambda optimizer: optimizer)
    with pytest.raises(ec.InvalidArgument, match="optimizer_wrap 'test_team_parallel:not_an_optimizer' returned a "
                                                 "list: expected a torch.optim.Optimizer"):
        ec.check_step("block_stack", train_step, world_size=2, optimizer_wrap=not_an_optimizer)


def reduce_every_micro_batch(model, optimizer, batch, micro_batches=3):
    """ZeRO-2's way: every micro-batch's backward all-reduces (no no_sync()), the sums add up in .grad."""
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
        (F.cross_entropy(model(x), y, reduction="sum") * dist.get_world_size() / samples).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_step_that_syncs_every_micro_batch_on_purpose_declares_it():
    """By default a faithful step syncs once per optimizer step: three syncs are a communication finding, with
    matching numbers. Declared, they are what the step must do, and a step that syncs once is the finding."""
    (undeclared,) = ec.check_step("mlp", reduce_every_micro_batch, world_size=2).outcomes
    assert undeclared.verdict is ec.Verdict.COMMUNICATION and undeclared.result.syncs == (3, 3, 3)
    assert "a faithful step does it 1 time(s)" in undeclared.describe()
    ec.check_step("mlp", reduce_every_micro_batch, world_size=2, syncs_per_step=3).assert_equivalent()
    (once,) = ec.check_step("mlp", train_step, world_size=2, syncs_per_step=3).outcomes
    assert once.verdict is ec.Verdict.COMMUNICATION and "a faithful step does it 3 time(s)" in once.describe()


@pytest.mark.parametrize(("arguments", "message"), [
    ({"syncs_per_step": 3}, "syncs_per_step=3 is not allowed without world_size: .*only DDP ranks sync gradients"),
    ({"world_size": 2, "syncs_per_step": 0}, "syncs=0.*an integer >= 1"),
    ({"world_size": 2, "syncs_per_step": 2, "pipeline": True}, "syncs_per_step=2 is not allowed with pipeline=True"),
])
def test_bad_sync_counts_are_named(arguments, message):
    with pytest.raises(ec.InvalidArgument, match=message):
        ec.check_step("mlp", reduce_every_micro_batch, **arguments)


def replicate_every_block(model):
    """HSDP on a W x 1 mesh: every block replicated on every rank, one rank per shard group (pure replication
    through FSDP2): its gradients are synchronised by the replicas' all-reduce alone, never reduce-scattered."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sync_every_micro_batch(model, optimizer, batch, micro_batches=3):
    reduce_every_micro_batch(model, optimizer, batch, micro_batches)


def test_a_one_rank_shard_group_syncs_by_its_all_reduce_and_is_counted():
    """With one rank per shard group FSDP2 all-reduces each block's gradient and reduce-scatters nothing: still one
    sync per block per step (5), not a missing one; a step syncing every one of 3 micro-batches makes 15."""
    (outcome,) = ec.check_step("block_stack", train_step, world_size=2, wrap=replicate_every_block).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT, outcome.describe()
    assert outcome.result.syncs == (5, 5, 5) and outcome.result.sync_wrappers == 5
    assert all(step["reduce_scatter"][0] == 0 for step in outcome.result.collectives)
    (every,) = ec.check_step("block_stack", sync_every_micro_batch, world_size=2, wrap=replicate_every_block).outcomes
    assert every.verdict is ec.Verdict.COMMUNICATION and every.result.syncs == (15, 15, 15), every.describe()


def test_ddp_options_beside_a_wrap_are_refused_not_ignored():
    """The team's wrap builds the model's wrapper itself: options for equivcheck's own DDP would never reach it."""
    with pytest.raises(ec.InvalidArgument, match=r"ddp_options=\{'static_graph': True\} is not allowed with "
                                                 r"wrap='test_team_parallel:shard_every_block': expected one of them"):
        ec.check_step("block_stack", train_step, world_size=2, wrap=shard_every_block,
                      ddp_options={"static_graph": True})
