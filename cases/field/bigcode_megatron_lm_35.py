"""bigcode-project/Megatron-LM#35: multi-query attention under TP never summed the shared K/V layer's input gradient.

BigCode's Megatron fork added multi-query attention (MQA): the query projection is column-parallel, each TP rank
holding its own heads, while one key/value projection (``key_value``) is shared by all heads and replicated on every
rank. Each rank's attention uses the shared K and V with its own heads only, so the gradient reaching the key/value
output is a partial sum over that rank's heads, and so are the gradients of the key_value weights and of its input.
The fork all-reduced the key_value weights' gradients over TP in the optimizer (``allreduce_key_value_grads``), so the
copies stayed in sync (the report: "at step 2400, the weights across TP-ranks are still perfectly in sync"), but not
the input gradient: everything before the attention (the input layernorm here) trained on its rank's heads only,
and MQA with TP > 1 diverged where TP = 1 did not. Pulls #36 and #37 proposed fixes; the one merged, "Kv grad
allreduce v2" (pull #39), puts the key/value output through ``copy_to_tensor_model_parallel_region``, whose backward
all-reduces the output's gradient, so the weights' and the input's gradients come out whole, and drops the
optimizer's reduction without sequence parallelism. Here the team's pre-norm MQA block (input layernorm, 2 query
heads, one shared key/value head, output projection, residual, per-token head) runs TP on 2 ranks; its sharded
weights are DTensors read back through ``full_tensor()``, key_value and the norm plain tensors every rank holds.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import (
    CLASSES, FEATURES, CopyToTensorParallelRegion, ReduceFromTensorParallelRegion, local, shard_, token_case,
    token_step,
)

BUG = Bug("bigcode-project/Megatron-LM", "issue", 35, "tensor",
          "MQA with TP: shared key_value layer's input grad (a per-rank partial sum) never all-reduced",
          fixed_by="pull #39", fix_acts="communication key_value")

HEADS, HEAD_DIM = 2, FEATURES // 2


class MultiQueryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(FEATURES)
        self.query = nn.Linear(FEATURES, HEADS * HEAD_DIM)
        self.key_value = nn.Linear(FEATURES, 2 * HEAD_DIM)
        self.dense = nn.Linear(HEADS * HEAD_DIM, FEATURES, bias=False)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.tp_group = None
        self.reduce_kv_output = True
        with torch.no_grad():
            self.input_layernorm.weight.uniform_(0.5, 1.5)
            self.input_layernorm.bias.uniform_(-0.5, 0.5)

    @staticmethod
    def attend(query, key_value):
        """The heads ``query`` holds, each against the one shared key and value."""
        q = query.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)  # [b, heads, s, d]
        k, v = (t.unsqueeze(1) for t in key_value.chunk(2, dim=-1))  # [b, 1, s, d]
        probs = F.softmax(q @ k.transpose(-2, -1) / HEAD_DIM ** 0.5, dim=-1)
        return (probs @ v).transpose(1, 2).flatten(-2)

    def forward(self, x):
        hidden = self.input_layernorm(x)
        if self.tp_group is None:
            mixed = self.dense(self.attend(self.query(hidden), self.key_value(hidden)))
        else:
            query = F.linear(CopyToTensorParallelRegion.apply(hidden, self.tp_group), local(self.query.weight),
                             local(self.query.bias))
            key_value = self.key_value(hidden)
            if self.reduce_kv_output:  # pull #39: the key/value output's gradient all-reduced over TP
                key_value = CopyToTensorParallelRegion.apply(key_value, self.tp_group)
            partial = F.linear(self.attend(query, key_value), local(self.dense.weight))
            mixed = ReduceFromTensorParallelRegion.apply(partial, self.tp_group)
        return self.head(x + mixed)


multi_query_block = ec.register_case(token_case(
    "field_multi_query_block", MultiQueryBlock,
    "input layernorm, multi-query attention (2 query heads, 1 shared key/value head), output projection, "
    "residual, per-token head, (12, 8, 8)"))


def tensor_parallel(model, mesh, reduce_kv_output=True):
    """The fork's layers on mesh['tp']: query column-parallel (each rank its head), dense row-parallel."""
    shard_(model.query, "weight", mesh["tp"], 0)
    shard_(model.query, "bias", mesh["tp"], 0)
    shard_(model.dense, "weight", mesh["tp"], 1)
    model.tp_group = mesh["tp"].get_group()
    model.reduce_kv_output = reduce_kv_output
    return model


def tensor_parallel_as_reported(model, mesh):
    return tensor_parallel(model, mesh, reduce_kv_output=False)


def allreduce_key_value_grads(model):
    """As reported: the optimizer's all-reduce of the key/value layer's gradients (after #39: under SP only)."""
    if not model.reduce_kv_output:
        for parameter in model.key_value.parameters():
            dist.all_reduce(parameter.grad, group=model.tp_group)


def train_step(model, optimizer, batch):
    return token_step(model, optimizer, batch, allreduce_key_value_grads)


def buggy():
    return ec.check_step("field_multi_query_block", train_step, mesh={"tp": 2}, parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_multi_query_block", train_step, mesh={"tp": 2}, parallelize=tensor_parallel)
