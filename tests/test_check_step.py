"""check_step / check_loop: a team's own training code against a reference, and the bugs it must catch.

The token step with the naive mean / K scaling is in test_user_gate.py, written as a team would.
"""

import pytest
import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck import Verdict


def clipped(step):
    """Wrap a step body so gradients are clipped to norm 0.05 once, just before the optimizer step."""
    def clipped_step(model, optimizer, batch):
        loss = step(model, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return clipped_step


def full_batch_backward(model, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    return loss.detach()


def accumulated_backward(model, batch, chunks=5):
    inputs, targets = batch
    total = 0.0
    for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
        loss = F.cross_entropy(model(x), y, reduction="sum") / len(targets)
        loss.backward()
        total += loss.detach()
    return total


def clipped_per_micro_batch(model, optimizer, batch, chunks=5):
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
        (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    optimizer.zero_grad()


def test_reference_as_a_step_with_the_same_clipping():
    reference = clipped(full_batch_backward)
    # The clipping bites: the clipped reference itself differs from plain full-batch training.
    (unclipped,) = ec.check_step("mlp", reference).outcomes
    assert unclipped.verdict is Verdict.MISMATCH
    ec.check_step("mlp", clipped(accumulated_backward), reference=reference).assert_equivalent()
    (per_chunk,) = ec.check_step("mlp", clipped_per_micro_batch, reference=reference).outcomes
    assert per_chunk.verdict is Verdict.MISMATCH and per_chunk.comparison.first_divergent_step == 0


def zeroed_inside_the_loop(model, optimizer, batch, chunks=5):
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
        optimizer.zero_grad()
        (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
    optimizer.step()


def stepped_per_micro_batch(model, optimizer, batch, chunks=5):
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
        (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_zeroing_inside_the_accumulation_loop_is_caught():
    (outcome,) = ec.check_step("mlp", zeroed_inside_the_loop).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0


def test_stepping_per_micro_batch_is_caught_as_a_step_count_problem():
    (outcome,) = ec.check_step("mlp", stepped_per_micro_batch).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert "optimizer steps: the reference took 3, the candidate 15" in outcome.comparison.problems


def scheduled_loop(backward, with_scheduler=True):
    """A whole training loop: the learning rate halves after every optimizer step."""
    def loop(model, optimizer, batches):
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        losses = []
        for batch in batches:
            losses.append(backward(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            if with_scheduler:
                scheduler.step()
        return losses
    loop.__qualname__ = f"{backward.__name__}{'_scheduled' if with_scheduler else ''}"
    return loop


def test_a_whole_loop_with_a_scheduler():
    reference = scheduled_loop(full_batch_backward)
    ec.check_loop("mlp", scheduled_loop(accumulated_backward), reference=reference).assert_equivalent()
    # The same loop without its scheduler: steps 0 and 1 take the same learning rate, step 1 takes the full
    # one instead of half, so the gradients recorded at step 2 (at the weights step 1 left) are the first to differ.
    (outcome,) = ec.check_loop("mlp", scheduled_loop(accumulated_backward, with_scheduler=False),
                               reference=reference).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 2
    assert outcome.regime == "loop:accumulated_backward"


def test_bad_steps_and_loops_are_named():
    with pytest.raises(ec.InvalidArgument, match=r"Expected a callable but got step=3 \(type=int\)"):
        ec.check_step("mlp", 3)
    with pytest.raises(ec.InvalidArgument, match=r"Expected a callable but got loop='x'"):
        ec.check_loop("mlp", "x")

    def short_loop(model, optimizer, batches):
        return [0.0]

    with pytest.raises(ec.InvalidArgument, match="returned 1 losses for 3 global batches: expected one loss per batch"):
        ec.check_loop("mlp", short_loop)
