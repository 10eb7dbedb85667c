"""modelscope/ms-swift#9947: Megatron GRPO gathered vocab-parallel log-probs through non-autograd all-reduces.

Under tensor parallelism Megatron-SWIFT's GRPO trainer took each token's log-probability from logits split over the
vocabulary with its own helpers: ``vocab_parallel_log_softmax`` all-reduced the maximum and the sum of exponentials
with plain ``torch.distributed.all_reduce``, and ``vocab_parallel_gather_logps`` picked the target's entry on the
rank that owns it, zeroed it elsewhere and summed the ranks with another plain all-reduce. The values were right,
but the collectives are invisible to autograd (the thread behind it, issue #9778, shows the ``c10d::allreduce_``
warning at every backward): a rank that does not own the target got no gradient through it, and the normaliser's
gradient reached only the local slice, so the vocabulary shards' logits gradients were wrong. The fix replaces the
gather with Megatron Core's ``vocab_parallel_cross_entropy``, whose custom backward keeps every shard's softmax
gradient and subtracts the target on its owner. Here the team's Megatron-style model keeps its logits
vocab-parallel on 2 TP ranks and the policy loss is reduced to its log-likelihood term (every advantage 1): the mean
negative log-probability of the sampled tokens, which one process takes over the whole vocabulary.
"""

import torch
import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import token_mean_step, vocab_parallel, vocab_parallel_cross_entropy

BUG = Bug("modelscope/ms-swift", "pull", 9947, "tensor",
          "GRPO log-probs from vocab-parallel logits via plain all_reduce: non-owner shards' grads lost",
          fix_acts="loss")


def vocab_parallel_log_softmax(logits, group):
    """As reported: the global max and sum of exponentials by plain (non-autograd) all-reduces."""
    logits_max = logits.max(dim=-1, keepdim=True)[0]
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - logits_max).sum(dim=-1, keepdim=True)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return logits - logits_max - torch.log(sum_exp)


def gather_logps_as_reported(logits, labels, group):
    """The target's log-probability on the rank that owns it, zeroed elsewhere, summed by a plain all-reduce."""
    log_probs = vocab_parallel_log_softmax(logits, group)
    partition_vocab_size = log_probs.shape[-1]
    vocab_start = dist.get_rank(group) * partition_vocab_size
    in_range_mask = (labels >= vocab_start) & (labels < vocab_start + partition_vocab_size)
    local_labels = (labels - vocab_start).clamp(min=0, max=partition_vocab_size - 1)
    gathered_logps = torch.gather(log_probs, dim=-1, index=local_labels.unsqueeze(-1)).squeeze(-1)
    gathered_logps = gathered_logps * in_range_mask.to(gathered_logps.dtype)
    dist.all_reduce(gathered_logps, op=dist.ReduceOp.SUM, group=group)
    return gathered_logps


def gather_logps(logits, labels, group):
    """The fix: Megatron Core's vocab-parallel cross entropy, negated."""
    return -vocab_parallel_cross_entropy(logits, labels, group)


def train_step(model, optimizer, batch, gather=gather_logps):
    inputs, targets = batch
    per_token_logps = gather(model(inputs), targets, model.tp_group)
    loss = -per_token_logps.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, gather=gather_logps_as_reported)


full_batch = token_mean_step  # one process: the sampled tokens' mean negative log-probability, whole vocabulary


def buggy():
    return ec.check_step("field_vocab_parallel_gpt", train_step_as_reported, full_batch, mesh={"tp": 2},
                         parallelize=vocab_parallel)


def fixed():
    return ec.check_step("field_vocab_parallel_gpt", train_step, full_batch, mesh={"tp": 2}, parallelize=vocab_parallel)
