"""OpenPipe/ART#619: Megatron LoRA's policy loss was each DP rank's token mean, averaged, not the global token mean.

ART's Megatron backend trains LoRA adapters on a frozen base: each data-parallel rank takes its packed sequence,
``loss_fn`` returns ``mean_policy_loss``, the policy loss summed over the rank's trainable (assistant) tokens and
divided by their count, and the ranks' gradients were averaged over the DP group. With unequal token counts across
the ranks that is the mean of the ranks' means, which weighs a token on a rank with few tokens more than one on a rank
with many, so the update drifted with the data-parallel layout (the pull's "DP token normalization", one of the
several failure modes it fixes; the others are tensor-parallel ones). The pull makes the micro-batch losses sums
(``reduction="sum"``) and hands the rank's trainable-token count to ``finalize_model_grads(num_tokens=...)``, which
sums the counts over the DP group and divides the gradients by the global count. Scaled down: the adapted
frozen-embedding LM on GRPO rollouts with 1 to 5 response tokens, ART's on-policy loss (CISPO's clipped
importance weight, here 1), 2 DDP ranks of 6 sequences each (torch's DDP averages where Megatron's, counting per
token, sums, so the global count is divided by the ranks). The first global batch splits its 38 response tokens
19 and 19 over the ranks, where the two normalisations agree; the second splits 21 and 16, and parts there.
"""

import dataclasses

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._adapters import FrozenEmbeddingLM
from equivcheck_cases.field._rl import ACTION, ADVANTAGE, MASK, all_reduced, policy_case, world_size

BUG = Bug("OpenPipe/ART", "pull", 619, "adapters",
          "Megatron LoRA loss divided by each DP rank's own token count, the ranks' means then averaged",
          fix_acts="loss")

EPSILON, EPSILON_HIGH = 1.0, 4.0  # loss_fn's defaults without ppo


def policy_loss(logits, targets):
    """``art.loss.loss_fn``'s policy loss per token, masked to the assistant tokens: ``-clip(ratio) * advantage *
    logprob``, the ratio against the rollout's log-probabilities (here the current ones detached)."""
    new_logprobs = F.log_softmax(logits, dim=-1).gather(-1, targets[..., ACTION].long().unsqueeze(-1)).squeeze(-1)
    prob_ratio = torch.exp(new_logprobs - new_logprobs.detach())
    advantages, assistant_mask = targets[..., ADVANTAGE], targets[..., MASK]
    clipped_ratio = torch.clip(prob_ratio.detach(), 1 - EPSILON, 1 + EPSILON_HIGH)
    return -(clipped_ratio * advantages * new_logprobs) * assistant_mask


LORA_POLICY = ec.register_case(dataclasses.replace(
    policy_case, name="field_art_lora_policy", model=FrozenEmbeddingLM, loss=policy_loss,
    description="LoRA policy (frozen embedding, adapted block and output layer) on GRPO rollouts, ART's policy loss "
                "per response token, averaged over the global batch's response tokens"))


def run_training_step(model, optimizer, batch, global_token_count=True):
    tokens, targets = batch
    loss_sum = policy_loss(model(tokens), targets).sum()
    num_tokens = targets[..., MASK].sum()  # this rank's trainable tokens
    if global_token_count:  # finalize_model_grads(num_tokens=...): the count summed over the DP group
        num_tokens = all_reduced(num_tokens) / world_size()  # DDP's average divides by the ranks once more
    loss = loss_sum / num_tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def run_training_step_as_reported(model, optimizer, batch):
    return run_training_step(model, optimizer, batch, global_token_count=False)


def buggy():
    return ec.check_step(LORA_POLICY, run_training_step_as_reported, world_size=2)


def fixed():
    return ec.check_step(LORA_POLICY, run_training_step, world_size=2)
