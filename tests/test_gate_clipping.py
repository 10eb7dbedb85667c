"""A team's step that clips: held to full batch clipped at the case's max_norm, told the exact reference where the
case declares none, and made to engage by the case's clip_scale where its gradients never reach the step's
threshold, with no change to the step (issue 64)."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec


def make_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def data_of(scale):
    def make_data():
        g = torch.Generator().manual_seed(0)
        return torch.randn(36, 8, generator=g) * scale, torch.randint(0, 4, (36,), generator=g)
    return make_data


def loss_per_item(out, target):
    return F.cross_entropy(out, target, reduction="none")


# Gradient norms of 1.3 to 14 at every step (inputs x 30), and 0.4 to 0.65 (inputs as drawn): clipping at 1.0
# engages in the first at every step and in the second never.
LOUD = ec.Case(name="clip_gate_loud", model=make_model, data=data_of(30.0), loss=loss_per_item, batch_size=12,
               steps=3, max_norm=1.0)
QUIET = ec.Case(name="clip_gate_quiet", model=make_model, data=data_of(1.0), loss=loss_per_item, batch_size=12,
                steps=3, max_norm=1.0)


def clips_once(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    for x, y in zip(inputs.chunk(3), targets.chunk(3)):
        (F.cross_entropy(model(x), y, reduction="sum") / len(inputs)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the team's constant
    optimizer.step()


def clips_each_micro_batch(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    for x, y in zip(inputs.chunk(3), targets.chunk(3)):
        (F.cross_entropy(model(x), y, reduction="sum") / len(inputs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def verdict(case, step):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ec.BlindSpotWarning)
        return ec.check_step(case, step).outcomes[0]


def test_a_case_that_declares_max_norm_holds_the_step_to_full_batch_clipped_there():
    faithful = verdict(LOUD, clips_once)
    assert faithful.verdict is ec.Verdict.EQUIVALENT, faithful.describe()
    assert "full_batch:max_norm=1.0: clipping engaged at 3 of 3 steps" in faithful.reason
    assert verdict(LOUD, clips_each_micro_batch).verdict is ec.Verdict.MISMATCH


def test_a_step_clipping_against_an_unclipped_reference_is_told_the_reference_that_clips_as_it_does():
    undeclared = dataclasses.replace(LOUD, name="clip_gate_undeclared", max_norm=None)
    outcome = verdict(undeclared, clips_once)
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert 'reference="full_batch:max_norm=1", or to Case(max_norm=1)' in outcome.comparison.hint, \
        outcome.comparison.hint
    assert verdict(dataclasses.replace(undeclared, name="clip_gate_told", max_norm=1.0),
                   clips_once).verdict is ec.Verdict.EQUIVALENT


def test_clipping_that_never_engages_is_said_with_the_clip_scale_that_engages_it_and_that_scale_catches_the_bug():
    assert verdict(QUIET, clips_each_micro_batch).verdict is ec.Verdict.EQUIVALENT  # the blind spot: the bug passes
    with pytest.warns(ec.BlindSpotWarning, match=r"never reaches max_norm \(1\).*clip_scale=(0\.\d+)") as caught:
        ec.check_step(QUIET, clips_once)
    scale = float(next(w for w in caught if "clip_scale" in str(w.message)).message.args[0]
                  .split("clip_scale=")[1].split(")")[0])
    engaged = dataclasses.replace(QUIET, name="clip_gate_engaged", clip_scale=scale)
    faithful = verdict(engaged, clips_once)
    assert faithful.verdict is ec.Verdict.EQUIVALENT, faithful.describe()
    assert f"clipping engaged at {scale:g} (clip_scale {scale:g}) at 3 of 3 steps" in faithful.reason
    assert verdict(engaged, clips_each_micro_batch).verdict is ec.Verdict.MISMATCH
    with warnings.catch_warnings():
        warnings.simplefilter("error", ec.BlindSpotWarning)  # engaged now: no clipping warning
        try:
            ec.check_step(engaged, clips_once)
        except ec.BlindSpotWarning as warning:
            assert "clipping" not in str(warning), warning


def test_clip_scale_leaves_torchs_clipping_as_it_was_after_the_run():
    before = torch.nn.utils.clip_grad._clip_grads_with_norm_
    verdict(dataclasses.replace(QUIET, name="clip_gate_restored", clip_scale=0.1), clips_once)
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is before


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), "0.5", True])
def test_clip_scale_must_be_a_positive_number(scale):
    with pytest.raises(ec.InvalidArgument, match=r"clip_scale=.*(is not allowed: expected a finite number > 0|type=)"):
        dataclasses.replace(QUIET, clip_scale=scale)


@pytest.mark.parametrize(("case", "pitfall", "twin", "max_norm"), [
    ("clip_on_shards", "fsdp_clip_averaged:world_size=2", "fsdp:world_size=2", 0.1),
    ("clip_on_shards", "hsdp_clip_over_replicas:replicate=2,shard=1", "hsdp:replicate=2,shard=1", 0.1),
    ("clip_on_experts", "ep_clip_local_experts:world_size=2", "ep:world_size=2", 2.0),
    ("clip_on_experts", "fsdp_ep_clip_local_experts:dp=2,ep=2", "fsdp_ep:dp=2,ep=2", 2.0),
    ("clip_on_stages", "pipeline_clip_tied_per_stage:stages=2,microbatches=4", "pipeline:stages=2,microbatches=4",
     2.0),
    # three stages: the middle rank holds a Tanh alone, no gradient, and still adds its zero in the norm's dtype
    ("clip_on_stages", "pipeline_clip_tied_per_stage:stages=3,microbatches=4", "pipeline:stages=3,microbatches=4",
     2.0),
], ids=["fsdp_averaged", "hsdp_over_replicas", "ep_local_experts", "fsdp_ep_local_experts", "pp_tied_per_stage",
        "pp_tied_per_stage_3"])
def test_a_norm_on_shards_counted_otherwise_is_caught_at_the_gradient_with_the_clips_hint(case, pitfall, twin,
                                                                                          max_norm):
    """FSDP2's, HSDP's, expert parallelism's and a pipeline's own clip counts each logical element once
    (clip_grad_norm_ over DTensors; each expert from its rank, summed over the ep group; a tied weight on its first
    stage) and is equivalent to the reference clipped once; a mean of the ranks' shard norms, squares summed over the
    replicas too, a rank's own experts alone, or a tied weight counted on both stages scale every gradient by another
    factor, which the hint reads as a clip's norm where both runs clip (issue 66)."""
    pitfall, twin = (f"{spec},max_norm={max_norm}" for spec in (pitfall, twin))
    outcomes = {o.regime: o for o in ec.check(case, [pitfall, twin], reference=f"full_batch:max_norm={max_norm}",
                                              locate=True).outcomes}
    caught = outcomes[pitfall]
    assert caught.verdict is ec.Verdict.EXPECTED_MISMATCH and caught.comparison.margin > 100, caught.describe()
    assert (caught.location.step, caught.location.phase) == (0, "gradient"), caught.describe()
    assert any(sign in caught.comparison.hint for sign in (
        "both runs clip: likely the clipping norm computed otherwise",  # one factor on every rank
        "likely each rank clipping by a norm of its own",  # a factor of each rank's own, on replicas
        "both runs clip: likely a clipping norm other than the whole")), caught.comparison.hint  # on shards
    assert outcomes[twin].verdict is ec.Verdict.EQUIVALENT, outcomes[twin].describe()
    steps = ec.get_case(case).steps
    assert f"{twin}: clipping engaged at {steps} of {steps} steps" in outcomes[twin].reason
