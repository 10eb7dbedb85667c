"""NVIDIA/Megatron-LM#7464: vocab-parallel label smoothing used the local vocabulary size and local mean log-prob.

Megatron's ``vocab_parallel_cross_entropy`` computes the loss of logits split over the classes on the TP ranks: the
maximum, the target's logit and the sum of exponentials are all-reduced, so the plain loss is exact. With
``label_smoothing > 0`` two quantities stayed local: the smoothing coefficient took ``vocab_size =
exp_logits.size(-1)``, the partition's width rather than the vocabulary's, and ``mean_log_probs`` averaged only this
rank's slice of the log-probabilities; the backward saved the same local size. The loss then differed from rank to
rank and from TP=1, and so did every gradient. The report measured TP1 against TP2 on a vocabulary of 8; pull #7466
(open), which fixes it, all-reduces the max-shifted logits' sum so every rank forms the global mean log-probability,
and uses the global vocabulary size in forward and backward. Here the team's Megatron-style model keeps its output
layer's logits vocab-parallel (4 classes, 2 per rank) and trains on the smoothed loss on 2 TP ranks; the reference
is one process computing the same smoothed objective over all 4 classes (the target's share ``1 - alpha``, every
other class ``alpha / (V - 1)``).
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import vocab_parallel, vocab_parallel_cross_entropy

BUG = Bug("NVIDIA/Megatron-LM", "issue", 7464, "tensor",
          "vocab-parallel label smoothing with the partition's vocab size and its local mean log-prob",
          fixed_by="pull #7466 (open)", fix_acts="loss")

LABEL_SMOOTHING = 0.1


def smoothed_token_mean(logits, targets):
    """One process: Megatron's smoothed loss over the whole vocabulary (the documented dense target)."""
    vocab_size = logits.shape[-1]
    smoothing = LABEL_SMOOTHING * vocab_size / (vocab_size - 1)
    log_probs = F.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return ((1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)).mean()


def full_batch(model, optimizer, batch):
    inputs, targets = batch
    loss = smoothed_token_mean(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch, global_smoothing=True):
    inputs, targets = batch
    losses = vocab_parallel_cross_entropy(model(inputs), targets, model.tp_group, LABEL_SMOOTHING, global_smoothing)
    loss = losses.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, global_smoothing=False)


def buggy():
    return ec.check_step("field_vocab_parallel_gpt", train_step_as_reported, full_batch, mesh={"tp": 2},
                         parallelize=vocab_parallel)


def fixed():
    return ec.check_step("field_vocab_parallel_gpt", train_step, full_batch, mesh={"tp": 2}, parallelize=vocab_parallel)
