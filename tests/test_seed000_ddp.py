"""Written as a team with seed 000's question would write it: our model has a cheap trunk and a
memory-hungry head; we accumulate gradients over the head only, on chunks of the trunk's detached
output, and we train on 2 DDP ranks. Does every rank end with full-batch training's gradients?"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec

VOCAB, WIDTH, CHUNKS = 40, 12, 3


class TrunkAndHead(nn.Module):
    def __init__(self, trunk: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head

    def forward(self, tokens):
        return self.head(self.trunk(tokens))


def make_model():
    trunk = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB))
    return TrunkAndHead(trunk, nn.Linear(VOCAB, VOCAB))


def make_data():
    return torch.randint(0, VOCAB, (24,)), torch.randint(0, VOCAB, (24,))


# Registered at the top level: the DDP ranks import this module to find the case and the steps.
CASE = ec.register_case(ec.Case(name="team_trunk_and_head", model=make_model, data=make_data,
                                loss=lambda logits, targets: F.cross_entropy(logits, targets, reduction="none"),
                                batch_size=12, steps=2))


def wrap_trunk_and_head(model):
    """How we wrap for DDP: the trunk and the head each on its own, so each can all-reduce on its own."""
    return TrunkAndHead(DistributedDataParallel(model.trunk), DistributedDataParallel(model.head))


def head_accumulated(trunk, head, tokens, targets, sync_context):
    """Our partial accumulation: the trunk once, the head per chunk of its detached output, the trunk's
    backward once. Each chunk's loss is its sum over this rank's sample count (DDP averages the ranks)."""
    features = trunk(tokens)
    detached = features.detach().requires_grad_()
    total = 0.0
    pieces = list(zip(detached.chunk(CHUNKS), targets.chunk(CHUNKS)))
    for i, (x, y) in enumerate(pieces):
        with sync_context(last=i == len(pieces) - 1):
            loss = F.cross_entropy(head(x), y, reduction="sum") / len(targets)
            loss.backward()
        total += loss.detach()
    features.backward(detached.grad)
    return total


def partial_step(parts, optimizer, batch):
    """Right: the head's all-reduce waits for its last chunk (no_sync() on the others)."""
    tokens, targets = batch
    loss = head_accumulated(parts.trunk, parts.head, tokens, targets,
                            lambda last: contextlib.nullcontext() if last else parts.head.no_sync())
    optimizer.step()
    optimizer.zero_grad()
    return loss


def partial_step_no_sync_on_every_chunk(parts, optimizer, batch):
    """A bug: no_sync() left on for the last chunk too, so the head is never all-reduced."""
    tokens, targets = batch
    loss = head_accumulated(parts.trunk, parts.head, tokens, targets, lambda last: parts.head.no_sync())
    optimizer.step()
    optimizer.zero_grad()
    return loss


def partial_step_syncing_every_chunk(parts, optimizer, batch):
    """Right numbers, wasted communication: the head all-reduces after every chunk."""
    tokens, targets = batch
    loss = head_accumulated(parts.trunk, parts.head, tokens, targets, lambda last: contextlib.nullcontext())
    optimizer.step()
    optimizer.zero_grad()
    return loss


def partial_step_inside_the_wrapper(model, optimizer, batch):
    """The naive version: the whole model in one DDP wrapper, the step reaching its parts inside it."""
    tokens, targets = batch
    loss = head_accumulated(model.module.trunk, model.module.head, tokens, targets,
                            lambda last: contextlib.nullcontext() if last else model.no_sync())
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_our_partial_step_matches_full_batch_on_two_ranks():
    report = ec.check_step(CASE, partial_step, world_size=2, wrap=wrap_trunk_and_head)
    report.assert_equivalent()
    # One all-reduce per wrapped module per step: the trunk's and the head's.
    assert report.outcomes[0].result.syncs == (2, 2)


def test_the_same_check_catches_no_sync_left_on_for_the_last_chunk():
    (outcome,) = ec.check_step(CASE, partial_step_no_sync_on_every_chunk, world_size=2,
                               wrap=wrap_trunk_and_head).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert outcome.comparison.hint.startswith("gradients were not all-reduced: at step 0 rank 1")
    assert outcome.result.syncs == (1, 1)  # the trunk's only


def test_the_same_check_counts_an_all_reduce_per_chunk():
    (outcome,) = ec.check_step(CASE, partial_step_syncing_every_chunk, world_size=2, wrap=wrap_trunk_and_head).outcomes
    assert outcome.verdict is ec.Verdict.COMMUNICATION and not outcome.comparison.mismatches  # the numbers are right
    assert outcome.comparison.problems[0].startswith("communication: step 0 all-reduced gradients 4 time(s)")
    assert outcome.comparison.problems[0].endswith(
        "a faithful step does it 2 time(s) (1 per wrapped module, 2 wrapped)")


def test_reaching_inside_one_wrapper_is_caught_with_the_synchronisation_named():
    report = ec.check_step(CASE, partial_step_inside_the_wrapper, world_size=2)
    with pytest.raises(ec.NotEquivalent, match="gradients were not all-reduced: at step 0 rank 1 held gradients"):
        report.assert_equivalent()
    (outcome,) = report.outcomes
    assert "no_sync() still on for the last micro-batch" in outcome.comparison.hint
    assert "zero_grad" not in outcome.comparison.hint
    assert outcome.result.syncs == (0, 0)
    assert any(p.startswith("ranks disagree") for p in outcome.comparison.problems)
