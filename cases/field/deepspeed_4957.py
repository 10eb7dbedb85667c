"""deepspeedai/DeepSpeed#4957: ZeRO divided the MoE parameters' gradients by the expert-data-parallel size twice.

ZeRO stage 1/2 reduces gradients bucket by bucket. A bucket holding MoE (expert) parameters is scaled in
``average_tensor`` by the expert-data-parallel world size before it is reduced over that group; pull #4695 also
passed ``divide=self.ipg_bucket_has_moe_params`` to the all-reduce, which divides by that size again. The experts'
gradients came out divided by the square of the expert-data-parallel size, where every other gradient is the mean
over the data-parallel ranks. The fix passes ``divide=False`` for those buckets, the scaling having been done. Here
ep=1 on 2 ranks: every rank holds every expert, each expert's expert-data-parallel group is the data-parallel group,
and one division by its size is the data-parallel mean (the division #5618 later questioned coincides with it).
"""

import functools

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import group, remember

BUG = Bug("deepspeedai/DeepSpeed", "pull", 4957, "moe",
          "ZeRO MoE buckets divided by the expert-data-parallel size twice: expert grads / edp^2",
          fix_acts="communication experts")


def parallelize(model, mesh):
    return remember(model, mesh, "dp")


def train_step(model, optimizer, batch, divide_again=False):
    inputs, labels = batch
    loss = F.cross_entropy(model(inputs), labels)  # this rank's micro-batch mean
    loss.backward()
    data_parallel = expert_data_parallel = group()  # ep = 1: the experts replicated over the data-parallel ranks
    for name, parameter in model.named_parameters():
        if name.startswith("experts."):  # a bucket with MoE params
            edp_world_size = dist.get_world_size(expert_data_parallel)
            parameter.grad.div_(edp_world_size)  # average_tensor's own scaling
            dist.all_reduce(parameter.grad, group=expert_data_parallel)
            if divide_again:  # all_reduce(..., divide=self.ipg_bucket_has_moe_params)
                parameter.grad.div_(edp_world_size)
        else:
            dist.all_reduce(parameter.grad, group=data_parallel)
            parameter.grad.div_(dist.get_world_size(data_parallel))
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


train_step_as_reported = functools.partial(train_step, divide_again=True)


def buggy():
    return ec.check_step("field_moe_vectors", train_step_as_reported, mesh={"dp": 2}, parallelize=parallelize)


def fixed():
    return ec.check_step("field_moe_vectors", train_step, mesh={"dp": 2}, parallelize=parallelize)
