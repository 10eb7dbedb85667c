"""What the field's RL post-training rows share: a rollout batch with uneven response lengths, a tiny policy and a
tiny critic over it, the per-token PPO losses the trainers compute, and the accumulation loop they run.

A rollout batch holds 24 sequences of 8 tokens: a prompt of 1 to 3 tokens, then a response of 1 to 5 tokens, then
padding. ``inputs`` are the token ids; ``targets`` carry, per position, the response (loss) mask, then the policy's
sampled token, its advantage (GRPO: the sequence's outcome reward, 1 or 0, normalised within its group of 4 samples of
one prompt, broadcast over its response tokens) and the reward itself, or, for the critic, the return (the outcome
reward: gamma = lambda = 1). The
cases' own loss is the per-token loss with the mask applied, one item per response token, so the default reference
(one process, the whole global batch) is the global token mean the trainers' ``token-mean`` modes mean.

The updates are on-policy: the log-probabilities (values) the rollout recorded are the current model's, detached, as
at the first mini-batch of a PPO epoch, so every ratio is 1 and no clip is active at the forward; the clipped losses are
kept as the trainers write them.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck_cases.rl import (ACTION, ADVANTAGE, BATCH_SIZE, CLIP_RATIO, DIM, GROUP, LENGTH, MASK, PAD,  # noqa: F401
                                 REWARD, SAMPLES, VOCAB, grpo_advantages, pg_loss_mat, rollouts, sgd)

RETURN = 1  # the critic's target channel (after the mask)
CLIP_RANGE_VALUE = 0.5


def policy_data(masked=()):
    tokens, mask, actions, rewards = rollouts(masked)
    targets = torch.stack([mask, actions.to(torch.float64), grpo_advantages(rewards, mask),
                           rewards[:, None].expand(-1, LENGTH)], dim=-1)
    return tokens, targets


def critic_data():
    tokens, mask, _, rewards = rollouts()
    return tokens, torch.stack([mask, rewards[:, None] * mask], dim=-1)


def response_tokens(targets):
    return int(targets[..., MASK].sum())


def policy():
    return nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, DIM), nn.Tanh(),
                         nn.Linear(DIM, VOCAB))


class Critic(nn.Module):
    """A value model: the policy's trunk and a scalar value head, one value per position."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, DIM), nn.Tanh())
        self.value_head = nn.Linear(DIM, 1)

    def forward(self, tokens):
        return self.value_head(self.trunk(tokens)).squeeze(-1)


def value_loss_mat(vpreds, targets):
    """The clipped value loss per token (verl's ``compute_value_loss`` before its aggregation), and the mask: the
    values the rollout recorded are the current ones detached."""
    values = vpreds.detach()
    returns = targets[..., RETURN]
    vpredclipped = values + torch.clamp(vpreds - values, -CLIP_RANGE_VALUE, CLIP_RANGE_VALUE)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    return torch.max(vf_losses1, vf_losses2), targets[..., MASK]


def masked_sum(values, mask):
    return (values * mask).sum()


def per_token_pg_loss(logits, targets):
    loss_mat, mask = pg_loss_mat(logits, targets)
    return loss_mat * mask


def per_token_value_loss(vpreds, targets):
    loss_mat, mask = value_loss_mat(vpreds, targets)
    return 0.5 * loss_mat * mask


policy_case = ec.register_case(ec.Case(
    name="field_rl_policy", model=policy, data=policy_data, loss=per_token_pg_loss, items=response_tokens,
    batch_size=BATCH_SIZE, steps=SAMPLES // BATCH_SIZE, optimizer=sgd,
    description="GRPO rollouts: 12 sequences a step, prompts of 1 to 3 tokens and responses of 1 to 5, the PPO "
                "surrogate per response token, averaged over the global batch's response tokens"))

critic_case = ec.register_case(ec.Case(
    name="field_rl_critic", model=Critic, data=critic_data, loss=per_token_value_loss, items=response_tokens,
    batch_size=BATCH_SIZE, steps=SAMPLES // BATCH_SIZE, optimizer=sgd,
    description="PPO critic on the same rollouts: the clipped value loss per response token, averaged over the "
                "global batch's response tokens"))


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduced(value):
    """``value`` summed over the data-parallel ranks (itself in one process)."""
    value = torch.as_tensor(value, dtype=torch.float64).clone()
    if dist.is_initialized():
        dist.all_reduce(value)
    return value


def micro_batches(batch, size):
    inputs, targets = batch
    return list(zip(inputs.split(size), targets.split(size)))


def accumulate(model, batch, size, loss_of):
    """The trainers' accumulation loop: ``loss_of(model, inputs, targets)`` backpropagated for every micro-batch of
    ``size`` samples, DDP's gradient sync on the last one only (no_sync before it; nothing to sync in one process)."""
    parts = micro_batches(batch, size)
    for index, (inputs, targets) in enumerate(parts):
        last = index == len(parts) - 1
        syncing = last or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if syncing else model.no_sync():
            loss_of(model, inputs, targets).backward()


def stepped(optimizer):
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
