"""Written as a team would write it: their own token model, data, accumulation step and DDP step,
gated in CI through the equivcheck fixture and the public API only."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

VOCAB, PAD, IGNORE = 16, 0, -100


def make_model():
    return nn.Sequential(nn.Embedding(VOCAB, 8, padding_idx=PAD), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, VOCAB))


def make_data():
    """16 sequences of 1 to 6 real tokens, padded to 6: 2 steps of 8."""
    lengths = torch.randint(1, 7, (16,))
    real = torch.arange(6) < lengths[:, None]
    inputs = torch.where(real, torch.randint(1, VOCAB, (16, 6)), PAD)
    return inputs, torch.where(real, torch.randint(1, VOCAB, (16, 6)), IGNORE)


def loss_per_token(logits, targets):
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return losses[targets.flatten() != IGNORE]


def count_tokens(targets):
    return int((targets != IGNORE).sum())


# Registered at the top level: the DDP ranks import this module to find the case and the step.
CASE = ec.register_case(ec.Case(name="team_tokens", model=make_model, data=make_data, loss=loss_per_token,
                                items=count_tokens, batch_size=8, steps=2))


def train_step(model, optimizer, batch, micro_batches=4):
    """The team's step: accumulate micro-batches, each token-loss sum over the global token count."""
    inputs, targets = batch
    tokens = (targets != IGNORE).sum()
    total = 0.0
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
        loss = loss_per_token(model(x), y).sum() / tokens
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total


def train_step_before_the_fix(model, optimizer, batch, micro_batches=4):
    """The same step with the 2024 trainer bug: each micro-batch's token mean, divided by K."""
    inputs, targets = batch
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
        (loss_per_token(model(x), y).mean() / micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_train_step_matches_full_batch(equivcheck):
    equivcheck.check_step(CASE, train_step)


def test_the_case_itself_passes_every_default_regime(equivcheck):
    equivcheck.check(CASE)  # its default list: every default regime that can run it


def test_the_gate_would_have_caught_the_bug():
    report = ec.check_step(CASE, train_step_before_the_fix)
    with pytest.raises(ec.NotEquivalent, match=r"grad of '0\.weight' mismatched from step 0"):
        report.assert_equivalent()
    assert report.outcomes[0].comparison.first_divergent_step == 0


def ddp_train_step(model, optimizer, batch):
    """The team's DDP step on this rank's shard: token-loss sum over the global token count, times the
    world size, because DDP averages the ranks' gradients."""
    inputs, targets = batch
    tokens = (targets != IGNORE).sum()
    dist.all_reduce(tokens)
    loss = loss_per_token(model(inputs), targets).sum() * dist.get_world_size() / tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def ddp_train_step_with_local_mean(model, optimizer, batch):
    """Wrong: each rank's token mean; DDP then weights ranks equally whatever their token counts."""
    inputs, targets = batch
    loss_per_token(model(inputs), targets).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_ddp_step_matches_full_batch(equivcheck):
    equivcheck.check_step(CASE, ddp_train_step, world_size=2)


def test_the_gate_catches_a_local_mean_under_ddp():
    report = ec.check_step(CASE, ddp_train_step_with_local_mean, world_size=2)
    (outcome,) = report.outcomes
    assert outcome.regime == "ddp_step:world_size=2,fn=test_user_gate:ddp_train_step_with_local_mean"
    with pytest.raises(ec.NotEquivalent, match=r"grad of '3\.bias' mismatched from step 0"):
        report.assert_equivalent()
