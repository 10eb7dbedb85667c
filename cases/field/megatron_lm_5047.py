"""NVIDIA/Megatron-LM#5047: with per-token loss the aux loss was scaled by the rank's token count, not its group's.

With ``--calculate-per-token-loss`` Megatron sums the token losses and ``finalize_model_grads`` divides every
gradient by the global token count, so an aux loss, a mean, has to be turned into a sum first: the router multiplied
it by ``num_local_tokens`` before attaching it (``MoEAuxLossAutoScaler``). Under tensor or context parallelism a
rank's tokens are a slice of its group's: the tokens per expert are summed over the TP x CP group and the loss divided
by the group's token count, so a rank's aux is its share of the group's aux, and the group's tokens, not the slice's,
are what it stands for. Scaled by the slice, the aux's gradient shrank by the TP x CP size: the same run on other TP
or CP sizes balanced its experts otherwise. The fix multiplies the scale by ``tp_cp_group.size()``. Here the group is
a context-parallel one of 2 ranks, each holding one half of every sequence (8 real tokens: halves of 4).
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import BALANCE_WEIGHT, EXPERTS, TOP_K, group, remember

BUG = Bug("NVIDIA/Megatron-LM", "pull", 5047, "moe",
          "per-token loss: aux scaled by the rank's token count, not its TP x CP group's: grads / (TP x CP)",
          fix_acts="loss")


def parallelize(model, mesh):
    return remember(model, mesh, "cp")


def train_step(model, optimizer, batch, times_tp_cp_size=True):
    tokens, labels = batch
    cp_size, cp_rank = dist.get_world_size(group()), dist.get_rank(group())
    tokens, labels = tokens.chunk(cp_size, dim=1)[cp_rank], labels.chunk(cp_size, dim=1)[cp_rank]
    logits, scores, routing_map = model(tokens)
    probs, routing_map = scores.softmax(-1).flatten(0, 1), routing_map.flatten(0, 1)
    num_local_tokens = torch.tensor(float(len(probs)), dtype=probs.dtype)
    tokens_per_expert = routing_map.sum(0)
    dist.all_reduce(tokens_per_expert, group=group())  # over the tp_cp group
    total_num_tokens = num_local_tokens.clone()
    dist.all_reduce(total_num_tokens, group=group())
    aux_loss = (EXPERTS * BALANCE_WEIGHT * (probs.sum(0) * tokens_per_expert).sum()
                / (TOP_K * total_num_tokens * total_num_tokens))  # this rank's share of the group's aux loss
    aux_loss_scale = num_local_tokens * (cp_size if times_tp_cp_size else 1)
    lm_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    total_global_tokens = total_num_tokens  # over dp x cp (one data-parallel rank here)
    ((lm_loss + aux_loss * aux_loss_scale) / total_global_tokens).backward()
    for parameter in model.parameters():  # finalize_model_grads: summed over dp x cp
        dist.all_reduce(parameter.grad, group=group())
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, times_tp_cp_size=False)


def buggy():
    return ec.check_step("field_moe_full", train_step_as_reported, mesh={"cp": 2}, parallelize=parallelize)


def fixed():
    return ec.check_step("field_moe_full", train_step, mesh={"cp": 2}, parallelize=parallelize)
