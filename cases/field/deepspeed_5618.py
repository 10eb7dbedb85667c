"""deepspeedai/DeepSpeed#5618: ZeRO averaged the experts' gradients over the expert-data-parallel group, not all ranks.

DeepSpeed's MoE spreads the experts over an expert-parallel group and exchanges tokens with ``all_to_all``, so an
expert's gradient on its rank already sums the contributions of every rank of that group; it is then reduced over the
expert-data-parallel group (the ranks that hold the same expert). ZeRO stage 1/2's ``average_tensor`` divided that sum
by the expert-data-parallel world size, where each rank's loss is the mean of its own micro-batch and the dense
gradients are divided by the whole data-parallel world size: with ``ep`` experts-parallel ranks the experts' gradients
came out ``ep`` times larger than with ep=1 (the report: 4 times at ep=4). The issue's second point was fixed for
ZeRO by pull #6546 (the bf16 optimizer by #5259): divide the experts' gradients by the data-parallel world size too.
Here ep=2 on 2 ranks: each expert lives on one rank, and its expert-data-parallel group is that rank alone.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import GROUP, expert_parallel_forward, gather_experts, remember

BUG = Bug("deepspeedai/DeepSpeed", "issue", 5618, "moe",
          "ZeRO + EP: expert grads divided by the expert-data-parallel size, not the DP size: ep times too big",
          fixed_by="pull #6546", fix_acts="communication experts")


def parallelize(model, mesh):
    GROUP["expert_data_parallel"] = mesh["dp"].get_group()  # the ranks holding the same experts
    return remember(model, mesh, "ep")


def gather(name, local):
    return gather_experts(name, local)


def train_step(model, optimizer, batch, expert_divisor="dp"):
    inputs, labels = batch
    loss = F.cross_entropy(expert_parallel_forward(model, inputs), labels)  # this rank's micro-batch mean
    loss.backward()
    dp_world_size = dist.get_world_size()  # ZeRO's data-parallel group: every rank
    expert_data_parallel = GROUP["expert_data_parallel"]
    edp_world_size = dist.get_world_size(expert_data_parallel)
    for name, parameter in model.named_parameters():
        if parameter.grad is None:  # an expert this rank does not hold
            continue
        if name.startswith("experts."):  # average_tensor, a MoE bucket
            parameter.grad.div_(edp_world_size if expert_divisor == "edp" else dp_world_size)
            dist.all_reduce(parameter.grad, group=expert_data_parallel)
        else:
            dist.all_reduce(parameter.grad)
            parameter.grad.div_(dp_world_size)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, expert_divisor="edp")


def buggy():
    return ec.check_step("field_moe_vectors", train_step_as_reported, mesh={"ep": 2}, parallelize=parallelize,
                         gather=gather)


def fixed():
    return ec.check_step("field_moe_vectors", train_step, mesh={"ep": 2}, parallelize=parallelize, gather=gather)
