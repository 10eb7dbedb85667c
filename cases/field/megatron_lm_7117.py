"""NVIDIA/Megatron-LM#7117: whether Muon split linear_qkv into Q, K and V was decided by the local shard's row count.

Megatron's Muon can orthogonalise a fused ``linear_qkv`` weight as three problems (each query group's Q rows, then its K
and V rows) rather than one matrix. The optimizer tagged a weight for that split when ``param.shape[0]`` was a multiple
of the QKV rows, and under generalized tensor parallelism (GTP) the weight it tested is the rank's row shard: unsharded
(6528 rows) it took 3 Newton-Schulz calls, under GTP64 (102 rows per rank) one whole-matrix call on the gathered
gradient, a rule the pull measured 26% apart overall and 95% on K and V, +0.173% training loss at 256 GPUs, with the
skip logged at DEBUG only. The fix decides on the logical shape and splits the fully gathered QKV gradient before
orthogonalising. The row shards a tiny attention classifier's rows over 2 ranks with FSDP2 (as GTP shards dim 0); the
team's Muon gathers each matrix for Newton-Schulz and keeps its rows, deciding the split from the local 12 rows of 24 as
reported, from the 24 as fixed.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import zeropower_via_newtonschulz5
from equivcheck_cases.field._references import fully_sharded, mean_loss_step

BUG = Bug("NVIDIA/Megatron-LM", "pull", 7117, "optimizer",
          "Muon's split of linear_qkv into Q, K, V was decided by the local shard's rows: none under GTP",
          fix_acts="optimizer attention.linear_qkv")

HIDDEN, GROUPS, HEADS_PER_GROUP, HEAD_DIM, TOKENS = 8, 2, 1, 4, 4
QKV_ROWS = GROUPS * (HEADS_PER_GROUP + 2) * HEAD_DIM  # 24: per query group its Q heads, one K and one V head
LR, MOMENTUM = 0.02, 0.95


class Attention(nn.Module):
    """Grouped-query self-attention with Megatron's fused ``linear_qkv`` (rows laid out query group by group)."""

    def __init__(self):
        super().__init__()
        self.linear_qkv = nn.Linear(HIDDEN, QKV_ROWS, bias=False)
        self.linear_proj = nn.Linear(GROUPS * HEADS_PER_GROUP * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        batch, tokens, _ = x.shape
        qkv = self.linear_qkv(x).view(batch, tokens, GROUPS, HEADS_PER_GROUP + 2, HEAD_DIM)
        q, k, v = qkv[..., :HEADS_PER_GROUP, :], qkv[..., HEADS_PER_GROUP:HEADS_PER_GROUP + 1, :], qkv[..., -1:, :]
        q, k, v = (t.permute(0, 2, 3, 1, 4) for t in (q, k, v))  # batch, group, head, token, dim
        out = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q))
        return self.linear_proj(out.permute(0, 3, 1, 2, 4).reshape(batch, tokens, -1))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.head = nn.Linear(HIDDEN, 3, bias=False)

    def forward(self, x):
        return self.head((x + self.attention(x)).mean(1))


def orthogonalize(grad, split):
    """Newton-Schulz with Muon's shape scale: of the whole matrix, or of each query group's Q, K and V rows apart."""
    if not split:
        return zeropower_via_newtonschulz5(grad) * max(1, grad.size(0) / grad.size(1)) ** 0.5
    rows = [HEADS_PER_GROUP * HEAD_DIM, HEAD_DIM, HEAD_DIM]
    blocks = [block.reshape(-1, grad.size(1)) for block in grad.view(GROUPS, -1, grad.size(1)).split(rows, dim=1)]
    done = [orthogonalize(block, split=False).view(GROUPS, -1, grad.size(1)) for block in blocks]
    return torch.cat(done, dim=1).view(grad.shape)


class Muon(torch.optim.Optimizer):
    """Megatron's Muon, cut down: momentum and Nesterov, each sharded matrix's gradient gathered for Newton-Schulz
    and this rank's rows of the update kept; ``linear_qkv`` split where it was tagged ``is_qkv``."""

    def __init__(self, named, local_rows_decide=False):
        self.named, params = list(named), []
        for name, p in self.named:
            rows = (p.to_local() if local_rows_decide and hasattr(p, "to_local") else p).shape[0]
            p.is_qkv = "linear_qkv" in name and rows % QKV_ROWS == 0  # the split-QKV tag
            params.append(p)
        super().__init__(params, dict(lr=LR, momentum=MOMENTUM))

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, distribute_tensor

        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                momentum = state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(momentum, group["momentum"])
                sharded = isinstance(update, DTensor)
                step = orthogonalize(update.full_tensor() if sharded else update, p.is_qkv)
                if sharded:  # this rank's rows of the whole update
                    step = distribute_tensor(step, p.device_mesh, p.placements, src_data_rank=None)
                p.add_(step, alpha=-group["lr"])


def megatron_muon(parameters):
    return Muon(parameters.model.named_parameters())


def data():
    return torch.randn(36, TOKENS, HIDDEN), torch.randint(0, 3, (36,))


CASE = ec.register_case(ec.Case(
    name="field_megatron_qkv_attention", model=Classifier, data=data, loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12, steps=3, optimizer=megatron_muon, regimes=("full_batch",),
    description="a grouped-query attention classifier with a fused linear_qkv, under Megatron's Muon"))


def tagged_on_local_rows(optimizer):
    """The team's Muon as reported: the split tag read from each parameter's local shard."""
    return Muon(optimizer.named, local_rows_decide=True)


def tagged_on_logical_rows(optimizer):
    return Muon(optimizer.named)


train_step = mean_loss_step  # each rank's mean loss over its equal shard; FSDP2 averages the gradients


def buggy():
    return ec.check_step(CASE, train_step, world_size=2, wrap=fully_sharded, optimizer_wrap=tagged_on_local_rows)


def fixed():
    return ec.check_step(CASE, train_step, world_size=2, wrap=fully_sharded, optimizer_wrap=tagged_on_logical_rows)
