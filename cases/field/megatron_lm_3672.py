"""NVIDIA/Megatron-LM#3672: the global aux loss came out as the aux loss divided by the data-parallel size.

Megatron's ``global_aux_loss`` balances the experts over the whole global batch: the tokens routed per expert are
summed over the TP x DP x CP group and ``switch_load_balancing_loss_func`` divides by the square of the group's total
token count, while the router probabilities it multiplies are the rank's own. Each rank's value is then its share of
the global batch's aux loss, and DDP averages the shares' gradients over the data-parallel ranks: the router got the
global aux loss's gradient divided by ``dp_size``, so the same coefficient balanced the experts ``dp_size`` times less
than with ``aux_loss``. The fix the report's pull proposes (pull #3769, closed unmerged; #3672 is open) multiplies
the global aux loss by ``dp_size``. The sequences here hold 8 real tokens each, so each rank's token mean of the
language-model loss, averaged by DDP, is the global batch's.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import BALANCE_WEIGHT, EXPERTS, TOP_K

BUG = Bug("NVIDIA/Megatron-LM", "issue", 3672, "moe",
          "global_aux_loss: local probs over the global token count squared, then DDP's mean: aux / dp_size",
          fixed_by="pull #3769 (closed unmerged)", fix_acts="loss")


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk, num_experts, moe_aux_loss_coeff):
    aggregated_probs_per_expert = probs.sum(dim=0)
    return (num_experts * moe_aux_loss_coeff * (aggregated_probs_per_expert * tokens_per_expert).sum()
            / (topk * total_num_tokens * total_num_tokens))


def train_step(model, optimizer, batch, times_dp_size=True):
    tokens, labels = batch
    logits, scores, routing_map = model(tokens)
    probs, routing_map = scores.softmax(-1).flatten(0, 1), routing_map.flatten(0, 1)
    global_tokens_per_expert = routing_map.sum(0)
    dist.all_reduce(global_tokens_per_expert)  # over the tp_dp_cp group
    total_num_tokens = torch.tensor(float(len(probs)), dtype=probs.dtype)
    dist.all_reduce(total_num_tokens)
    global_aux_loss = switch_load_balancing_loss_func(probs, global_tokens_per_expert, total_num_tokens, TOP_K,
                                                      EXPERTS, BALANCE_WEIGHT)
    if times_dp_size:
        global_aux_loss = global_aux_loss * dist.get_world_size()
    lm_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # the micro-batch's token mean; DDP averages
    (lm_loss + global_aux_loss).backward()
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, times_dp_size=False)


def buggy():
    return ec.check_step("field_moe_full", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_moe_full", train_step, world_size=2)
