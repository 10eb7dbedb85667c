"""RL post-training losses aggregated as the trainers aggregate them (``ec.Aggregated``), one built-in case per mode.

A rollout batch of 24 sequences of 8 tokens (prompts of 1 to 3 tokens, responses of 1 to 5, padding after them;
the field's RL rows draw the same), a tiny policy with a value head, and the objective the PPO trainers write: the
clipped policy-gradient surrogate per response token with GRPO's group-normalised advantages, aggregated by the
case's mode (``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` over a
constant length of 5); a KL penalty against a fixed reference policy (the k3 estimator per response token, a term
averaged over the global batch's response tokens, weight 0.05); and the value loss per response token (a term,
weight 0.5). Every faithful regime adds each micro-batch's (each rank's) sums over the global batch's units, so
accumulation, DDP (with ``no_sync()``) and FSDP2 are equivalent under every mode. The pitfalls beside them, caught
and located at ``loss`` (tests/test_rl.py, the catalogue):

- ``naive_accumulate:chunks=5``: the mean of micro-batch means, each micro-batch normalised by its own units
  (NovaSky-AI/SkyRL pull #1296) over the uneven micro-batches of 3, 3, 2, 2 and 2 sequences;
- ``ddp_mean_loss:world_size=2``: each rank's objective over its own units (verl's legacy actor, verl#5625);
- ``terms_per_micro_batch:chunks=3``: the policy loss right, the KL and value terms normalised per micro-batch
  (volcengine/verl pull #6957's critic);
- ``accumulate_divided_twice:chunks=3``: every micro-batch's share divided by the accumulation steps again
  (modelscope/ms-swift#10117).
"""

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

VOCAB, DIM, LENGTH, PAD = 16, 8, 8, 0
SAMPLES, BATCH_SIZE, GROUP = 24, 12, 4
MASK, ACTION, ADVANTAGE, REWARD = 0, 1, 2, 3  # the policy's target channels
CLIP_RATIO = 0.2
REFERENCE = 4  # the target channel of the reference policy's log-probability of the sampled token
KL_WEIGHT, VALUE_WEIGHT, NORM_LENGTH = 0.05, 0.5, 5  # NORM_LENGTH: the longest response, Dr. GRPO's constant


def rollouts(masked=()):
    """The rollout batches: token ids, the response mask, the sampled tokens and the per-sequence outcome rewards.
    ``masked``: samples dropped from the loss whole (a response cut for exceeding the maximum sequence length: its
    mask is 0 everywhere)."""
    generator = torch.Generator().manual_seed(2026)
    prompt = torch.randint(1, 4, (SAMPLES,), generator=generator)
    response = torch.randint(1, 6, (SAMPLES,), generator=generator)
    position = torch.arange(LENGTH)
    mask = (position >= prompt[:, None]) & (position < (prompt + response)[:, None])
    real = position < (prompt + response)[:, None]
    tokens = torch.where(real, torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=generator), PAD)
    actions = torch.where(mask, torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=generator), PAD)
    rewards = (torch.rand(SAMPLES, generator=generator) < 0.5).to(torch.float64)  # a verifier's 1 or 0
    mask = mask.to(torch.float64)
    for sample in masked:
        mask[sample] = 0.0
    return tokens, mask, actions, rewards


def grpo_advantages(rewards, mask):
    """GRPO's outcome advantage: each reward normalised by its group's mean and std, on every response token."""
    groups = rewards.view(-1, GROUP)
    scores = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
    return scores.reshape(-1, 1) * mask


def pg_loss_mat(logits, targets):
    """The PPO clipped surrogate per token (verl's ``compute_policy_loss_vanilla``, SkyRL's ``ppo_policy_loss``), and
    the response mask: the ratio against the rollout's log-probabilities, here the current ones detached."""
    log_prob = F.log_softmax(logits, dim=-1).gather(-1, targets[..., ACTION].long().unsqueeze(-1)).squeeze(-1)
    old_log_prob = log_prob.detach()
    advantages = targets[..., ADVANTAGE]
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - CLIP_RATIO, 1 + CLIP_RATIO)
    return torch.maximum(pg_losses, pg_losses2), targets[..., MASK]


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.5, momentum=0.9)


class PolicyWithValue(nn.Module):
    """A token model with a policy head (the next token's logits) and a value head (one value per position)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, DIM), nn.Tanh())
        self.policy, self.value = nn.Linear(DIM, VOCAB), nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.trunk(tokens)
        return self.policy(hidden), self.value(hidden).squeeze(-1)


def data():
    """The rollouts, with per token: the response mask, the sampled token, its GRPO advantage, the outcome reward (the
    value's return) and a fixed reference policy's log-probability of the token (drawn in [-3, -1])."""
    tokens, mask, actions, rewards = rollouts()
    reference = -1 - 2 * torch.rand(SAMPLES, LENGTH, generator=torch.Generator().manual_seed(67), dtype=mask.dtype)
    targets = torch.stack([mask, actions.to(torch.float64), grpo_advantages(rewards, mask),
                           rewards[:, None] * mask, reference * mask], dim=-1)
    return tokens, targets


def response_mask(targets: torch.Tensor) -> torch.Tensor:
    return targets[..., MASK]


def policy_gradient(output, targets):
    return pg_loss_mat(output[0], targets)[0]


def kl_penalty(output, targets):
    """The k3 estimator of KL(policy || reference) per token (verl's ``low_var_kl``, GRPO's)."""
    log_prob = F.log_softmax(output[0], dim=-1).gather(-1, targets[..., ACTION].long().unsqueeze(-1)).squeeze(-1)
    difference = targets[..., REFERENCE] - log_prob
    return difference.exp() - difference - 1


def value_loss(output, targets):
    """The squared error of each position's value to its return (PPO's clipped value loss is this on-policy, where
    the values the rollout recorded are the current ones)."""
    return (output[1] - targets[..., REWARD]) ** 2


FAITHFUL = ("full_batch", "accumulate:chunks=3", "ddp_no_sync:world_size=2,chunks=2", "fsdp:world_size=2",
            "sample_by_sample")
PITFALLS = {
    "naive_accumulate": "each micro-batch normalised by its own units, the means averaged (SkyRL#1296)",
    "ddp_mean_loss": "each rank's objective over its own units (verl#5625)",
    "terms_per_micro_batch": "the KL and value terms normalised per micro-batch (verl#6957's critic)",
    "accumulate_divided_twice": "each share divided by the accumulation steps again (ms-swift#10117)",
}

def rl_case(mode: str) -> ec.Case:
    """The policy-gradient case whose surrogate aggregates by ``mode``; the KL and value terms by token-mean."""
    surrogate = ec.Aggregated(policy_gradient, response_mask, mode,
                              NORM_LENGTH if mode == "seq-mean-token-sum-norm" else 0)
    kl, value = (ec.Aggregated(per_token, response_mask) for per_token in (kl_penalty, value_loss))
    return ec.Case(
        name=f"rl_{mode.replace('-', '_')}", model=PolicyWithValue, data=data, loss=surrogate.loss,
        items=surrogate.units, batch_size=BATCH_SIZE, steps=SAMPLES // BATCH_SIZE, optimizer=sgd,
        terms=(ec.Term("kl", kl.loss, kl.units, KL_WEIGHT), ec.Term("value", value.loss, value.units, VALUE_WEIGHT)),
        # the matrix's (the token mean shows SkyRL's pitfall beside its twins); tests/test_rl.py runs them all
        regimes=(*FAITHFUL, "naive_accumulate:chunks=5") if mode == "token-mean" else FAITHFUL[:2],
        expect_mismatch=PITFALLS,
        description=f"GRPO rollouts, the PPO surrogate aggregated by {mode}, a KL and a value term by token-mean")


RL_CASES = {mode: ec.register_case(rl_case(mode)) for mode in ec.AGGREGATIONS}

# The catalogue's entries of the pitfalls this family adds (naive_accumulate's and ddp_mean_loss's have their own).
add_entry(Entry("RL: the KL and value terms normalised per micro-batch", "rl_token_mean",
                "terms_per_micro_batch:chunks=3"))
add_entry(Entry("RL: the loss divided by the accumulation steps twice", "rl_token_mean",
                "accumulate_divided_twice:chunks=3"))
