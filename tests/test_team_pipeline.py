"""A team's own step under a pipeline schedule (torch.distributed.pipelining), checked as the team runs it: each
rank builds its stage of the whole model it is handed, GPipe splits the whole global batch, and the gate
compares the whole model's gradients (every stage's, gathered from the rank that holds it) with full batch;
beside it the bug the gate must catch."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import equivcheck as ec

MICRO_BATCHES = 4
IGNORE = -100  # the padding's target in the token cases


def our_stage(model):
    """This rank's stage: block_stack's 5 children cut 3 + 2, rank 0 the first stage, rank 1 the last."""
    children = list(model.children())
    cut = (len(children) + 1) // 2
    mine = children[:cut] if dist.get_rank() == 0 else children[cut:]
    return PipelineStage(nn.Sequential(*mine), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def global_mean_part(output, target, items):
    """A micro-batch's loss: its sum over the global batch's samples (the micro-batches' add up to the mean)."""
    return F.cross_entropy(output, target, reduction="sum") / items


def global_token_mean_part(output, target, items):
    """On padded token sequences: a micro-batch's sum over its real tokens, over the global batch's real tokens."""
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum") / items


def micro_batch_token_mean(output, target):
    """The pairing torch's docstring suggests: each micro-batch's own mean, averaged by scale_grads=True."""
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE)


def pipelined_step(loss_fn=global_mean_part, items=len, scale_grads=False, set_to_none=True, report=torch.sum):
    """Our step, made afresh for every run (per_run=True): its stage and GPipe schedule are built on the first
    call and kept, as a PipelineStage infers the shapes it sends on its first step. scale_grads=False: the
    micro-batches' gradients add up, unscaled. ``loss_fn`` reads the global batch's ``items`` from the step that
    runs it (torch 2.11's schedule.step() takes no loss_kwargs). The last stage returns the step's loss
    (``report`` of the micro-batches'), the first None."""
    schedule = global_items = None

    def step(model, optimizer, batch):
        nonlocal schedule, global_items
        inputs, targets = batch
        global_items = items(targets) if items else None
        if schedule is None:
            per_micro_batch = (lambda output, target: loss_fn(output, target, global_items)) if items else loss_fn
            schedule = ScheduleGPipe(our_stage(model), n_microbatches=MICRO_BATCHES, loss_fn=per_micro_batch,
                                     scale_grads=scale_grads)
        losses = []
        if dist.get_rank() == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        return report(torch.stack(losses)).detach() if losses else None

    return step


def train_step():
    return pipelined_step()


def train_step_keeping_zeroed_gradients():
    """Right too: zero_grad(set_to_none=False) leaves zeros, not None, on every rank for the other stage."""
    return pipelined_step(set_to_none=False)


def train_step_forgetting_scale_grads():
    """Wrong: the schedule's default scale_grads=True divides the summed gradients by K again: every one 1/K."""
    return pipelined_step(scale_grads=True)


def token_step():
    return pipelined_step(global_token_mean_part, items=lambda targets: int((targets != IGNORE).sum()))


def token_step_with_micro_batch_means():
    """Wrong where micro-batches hold unequal numbers of real tokens: each token weighs 1 / (K x its micro-batch's)."""
    return pipelined_step(micro_batch_token_mean, items=None, scale_grads=True, report=torch.mean)


def train_loop(model, optimizer, batches):
    step = train_step()
    return [step(model, optimizer, batch) for batch in batches]


@pytest.fixture(scope="module")
def under_gpipe():
    return ec.check_step("block_stack", train_step, world_size=2, pipeline=True, per_run=True)


def test_our_pipeline_step_matches_full_batch(under_gpipe):
    (outcome,) = under_gpipe.outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.describe()
    assert outcome.regime == "pipeline_step:world_size=2,fn=test_team_pipeline:train_step,per_run=1"
    # Every rank stepped the whole gradient: the last stage's, held on rank 1, was recorded on rank 0 too.
    result = outcome.result
    assert result.rank_spread == 0 and all(spread == 0 for step in result.rank_grad_spread for spread in step)
    head = [name for name in result.grads[0] if name.startswith("4.")]
    assert head and all(result.grads[0][name].abs().max() > 0 for name in head)
    assert all(loss is not None for loss in result.losses)


def test_the_schedules_sends_and_receives_are_counted_and_the_gathering_is_not(under_gpipe):
    """Rank 0 holds the first stage: per step it sends K micro-batches of activations and receives K activation
    gradients; on the first step also the shapes (PipelineStage infers them then), and in torch 2.15 the schedule's
    all-reduces that set its stages up. The harness's gathering of the stages' gradients (and of the losses) is its
    own, for the report: not counted."""
    case = ec.get_case("block_stack")
    model, (inputs, _) = case.model().double(), case.data()
    activations = model[:3](inputs[: case.batch_size // MICRO_BATCHES].double())
    each = activations.numel() * activations.element_size()
    (outcome,) = under_gpipe.outcomes
    first, *later = outcome.result.collectives
    k = MICRO_BATCHES
    assert later == [{"send": (k, k * each), "recv": (k, k * each)}] * 2, outcome.result.collectives
    assert first["send"][0] > k and first["recv"][0] >= k  # and the shapes, once
    assert set(first) - {"all_reduce"} == {"send", "recv"}, first
    assert outcome.result.syncs is None  # stages exchange activations: there is no gradient sync to judge


def test_gradients_left_as_zeros_on_the_other_stage_are_not_taken_for_its_own():
    (outcome,) = ec.check_step("block_stack", train_step_keeping_zeroed_gradients, world_size=2, pipeline=True,
                               per_run=True).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.describe()


def test_the_gate_catches_our_pipeline_step_forgetting_scale_grads():
    (outcome,) = ec.check_step("block_stack", train_step_forgetting_scale_grads, world_size=2, pipeline=True,
                               per_run=True).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH and outcome.comparison.margin > 100, outcome.describe()


def test_on_uneven_token_counts_the_global_token_mean_matches_and_micro_batch_means_are_caught():
    """pipeline_uneven_tokens: 12 sequences of 1 to 7 real tokens per global batch, 4 micro-batches of 3."""
    steps = [token_step, token_step_with_micro_batch_means]
    right, wrong = (ec.check_step("pipeline_uneven_tokens", step, world_size=2, pipeline=True, per_run=True).outcomes[0]
                    for step in steps)
    assert right.verdict is ec.Verdict.EQUIVALENT and right.comparison.margin < 1e-2, right.describe()
    assert wrong.verdict is ec.Verdict.MISMATCH and wrong.comparison.margin > 100, wrong.describe()


def test_our_pipeline_loop_matches_full_batch(equivcheck):
    equivcheck.check_loop("block_stack", train_loop, world_size=2, pipeline=True)


@pytest.mark.parametrize(("arguments", "message"), [
    ({}, "pipeline=True is not allowed without world_size: expected world_size= with it (a pipeline's stages are "
         "spread over ranks, one each)"),
    ({"world_size": 2, "ddp_options": {"static_graph": True}},
     "ddp_options={'static_graph': True} is not allowed with pipeline=True: expected ddp_options=None (a pipeline "
     "takes no DDP"),
    ({"world_size": 2, "wrap": nn.Identity}, "is not allowed with pipeline=True: expected wrap=None"),
    ({"world_size": 2, "optimizer_wrap": list}, "optimizer_wrap=<class 'list'> is not allowed with pipeline=True"),
])
def test_a_pipeline_without_ranks_or_with_ddp_is_a_usage_error(arguments, message):
    with pytest.raises(ec.InvalidArgument, match=re.escape(message)):
        ec.check_step("block_stack", train_step, pipeline=True, **arguments)


def test_pipeline_is_a_flag():
    with pytest.raises(ec.InvalidArgument, match="Expected bool but got pipeline='gpipe'"):
        ec.check_loop("block_stack", train_loop, world_size=2, pipeline="gpipe")
