"""pytorch/torchtitan#4245: GPT-OSS grouped experts under TP added their replicated output bias on every rank.

Without expert parallelism torchtitan's GPT-OSS shards every expert's hidden dimension over the TP ranks: the first
projection (with its bias) by its outputs, the second by its inputs, so each rank's experts return a partial sum that
is reduced over TP after the experts. The second projection's bias is replicated, so ``GptOssGroupedExperts.forward``
scales it by ``1 / tp_degree`` with ``ScaleBiasForward`` (its gradient passed back unscaled) before the partial
outputs are summed. It read ``tp_degree`` only where ``mlp1_weight_EGD`` was a DTensor; under the default
``spmd_types`` backend the sharded parameters are plain ``nn.Parameter`` shards, the test never held, ``tp_degree``
stayed 1, and every TP rank added the full bias: the experts' output carried it TP times. The fix reads the degree
from the backend's mesh. Here a torchtitan-style MoE layer (router, top-1 of 2 GPT-OSS experts with biases and the
clamped, interleaved SwiGLU, scores applied after the experts) between an input projection and a per-token head
runs on 2 TP ranks whose expert shards are plain tensors, as under ``spmd_types``, read back whole by the team's
gather; the experts' region boundary (its input's gradient summed, its output reduced) sits inside their module.
"""

import torch
import torch.distributed as dist
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import (
    EXPERT_HIDDEN, EXPERTS, FEATURES, CopyToTensorParallelRegion, MoEModel, ReduceFromTensorParallelRegion,
    token_case, token_step,
)

BUG = Bug("pytorch/torchtitan", "pull", 4245, "moe",
          "GPT-OSS experts' replicated output bias not scaled by 1/TP under spmd_types: added TP times",
          fix_acts="forward moe.experts")

SHARDED = {"moe.experts.mlp1_weight": 1, "moe.experts.mlp1_bias": 1, "moe.experts.mlp2_weight": 2}


class ScaleBiasForward(torch.autograd.Function):
    """The bias scaled by 1/tp_degree in forward, its gradient passed back as it is."""

    @staticmethod
    def forward(ctx, bias, tp_degree):
        return bias / tp_degree if tp_degree > 1 else bias

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def swiglu(x, alpha=1.702, limit=7.0):
    x_glu, x_linear = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(min=-limit, max=limit)
    out_glu = x_glu * torch.sigmoid(alpha * x_glu)
    return torch.addcmul(out_glu, out_glu, x_linear)  # GPT-OSS's extra bias of 1 on the linear half


class GptOssGroupedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp1_weight = nn.Parameter(torch.randn(EXPERTS, 2 * EXPERT_HIDDEN, FEATURES) * 0.3)
        self.mlp1_bias = nn.Parameter(torch.randn(EXPERTS, 2 * EXPERT_HIDDEN) * 0.3)
        self.mlp2_weight = nn.Parameter(torch.randn(EXPERTS, FEATURES, EXPERT_HIDDEN) * 0.3)
        self.mlp2_bias = nn.Parameter(torch.randn(EXPERTS, FEATURES))
        self.tp_group = None  # set by the TP plan: the spmd_types backend's tp mesh dimension
        self.degree_from_backend = True

    def tp_degree(self):
        """As fixed, the active backend's TP degree; as reported, 1 unless the weights are DTensors, which the
        spmd_types backend's plain shards never are."""
        if self.tp_group is not None and self.degree_from_backend:
            return dist.get_world_size(self.tp_group)
        return 1

    def forward(self, x, num_tokens_per_expert):
        tp_degree = self.tp_degree()
        if self.tp_group is not None:
            x = CopyToTensorParallelRegion.apply(x, self.tp_group)
        outputs = []
        for e, tokens in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            hidden = swiglu(tokens @ self.mlp1_weight[e].T + self.mlp1_bias[e])
            outputs.append(hidden @ self.mlp2_weight[e].T + ScaleBiasForward.apply(self.mlp2_bias[e], tp_degree))
        out = torch.cat(outputs)
        if self.tp_group is not None:  # the Partial output reduced over TP
            out = ReduceFromTensorParallelRegion.apply(out, self.tp_group)
        return out


class GptOssModel(MoEModel):
    def __init__(self) -> None:
        super().__init__(score_before_experts=False)
        self.moe.experts = GptOssGroupedExperts()


gpt_oss_moe = ec.register_case(token_case(
    "field_gpt_oss_moe", GptOssModel,
    "input projection, a top-1 MoE of 2 GPT-OSS experts (biased projections, clamped SwiGLU, scores after the "
    "experts), per-token head, (12, 8, 8)"))


def tensor_parallel(model, mesh, degree_from_backend=True):
    """The experts' hidden dimension over mesh['tp'] as plain shards: mlp1 (weight and bias) by its outputs, mlp2 by
    its inputs, mlp2's bias replicated."""
    experts, group = model.moe.experts, mesh["tp"].get_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, dim in SHARDED.items():
        attribute = name.rsplit(".", 1)[1]
        full = getattr(experts, attribute).detach()
        setattr(experts, attribute, nn.Parameter(full.chunk(size, dim=dim)[rank].clone()))
    experts.tp_group, experts.degree_from_backend = group, degree_from_backend
    return model


def tensor_parallel_as_reported(model, mesh):
    return tensor_parallel(model, mesh, degree_from_backend=False)


def gather(name, local):
    """A sharded expert tensor whole: the TP ranks' shards concatenated along its sharded dimension."""
    if name not in SHARDED:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, local.contiguous())
    return torch.cat(shards, dim=SHARDED[name])


def buggy():
    return ec.check_step("field_gpt_oss_moe", token_step, mesh={"tp": 2}, parallelize=tensor_parallel_as_reported,
                         gather=gather)


def fixed():
    return ec.check_step("field_gpt_oss_moe", token_step, mesh={"tp": 2}, parallelize=tensor_parallel, gather=gather)
