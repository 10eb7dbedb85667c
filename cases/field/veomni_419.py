"""ByteDance-Seed/VeOmni#419: async Ulysses ran the k-norm backward before collecting k's gradient from its all-to-all.

VeOmni's async Ulysses sequence parallelism for DiT models (``async_ulysses_dit.py``) fuses the q/k/v projections,
their RMSNorms (over the whole hidden size) and the all-to-alls that trade each rank's chunk of the sequence for its
share of the heads into one autograd function, overlapping communication with compute. Its backward launches the
all-to-all that brings k's gradient back to this rank's sequence chunk, then, before collecting it, ran the k-norm
backward (``rms_backward_affine``) on the tensor still laid out as [full sequence, local heads], and only then
collected the result, overwriting the norm's input gradient with the raw one. So the k projection was trained as if
k had no norm, and the k-norm weight got a gradient computed from misplaced values (the fused kernel reads the
buffer as rows of the hidden size, whatever its layout), where one process back-propagates through the norm. The
fix (pull #419) collects ``grad_k`` first and runs the norm's backward on it (it also corrected off-by-one
``needs_input_grad`` indices, which read the same flags here). Here the team's attention block runs Ulysses over the
mesh's ``tp`` dimension (2 ranks, each TP group handed the same batch, as Ulysses' group is; each rank keeps its
half of the sequence) with VeOmni's function written in torch (the kernel's row-wise RMSNorm formulas in place of
``fused_layer_norm_cuda``); every weight is replicated and plain, and the step sums their gradients over the group.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import CLASSES, FEATURES, token_data, token_loss

BUG = Bug("ByteDance-Seed/VeOmni", "pull", 419, "tensor",
          "async Ulysses: k-norm backward ran before grad_k's all-to-all was collected: k trained unnormed",
          fix_acts="backward k_norm")

HEADS, EPS = 2, 1e-6
HEAD_DIM = FEATURES // HEADS
SEQ_DIM, HEAD_DIM_AXIS = 1, 2  # [batch, sequence, heads * head_dim]


class RMSNorm(nn.Module):
    """The wan model's RMSNorm, over the whole hidden size (not per head)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * self.weight


class Attention(nn.Module):
    """q, k, v projections with q/k RMSNorm, attention over 2 heads, the output projection and its residual, then a
    per-token head."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(FEATURES, FEATURES) for _ in range(3))
        self.q_norm, self.k_norm = RMSNorm(FEATURES), RMSNorm(FEATURES)
        self.proj_o = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.sp_group = None
        self.backward_as_reported = False
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        if self.sp_group is not None:
            return self.head(x + ulysses_attention(self, x))
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        return self.head(x + self.proj_o(attend(q, k, v)))


def attend(q, k, v):
    """[batch, sequence, heads * head_dim] in and out; the heads are those the tensors hold."""
    split = [t.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*split).transpose(1, 2).flatten(-2)


ulysses_attention_block = ec.register_case(ec.Case(
    name="field_ulysses_attention",
    model=Attention,
    data=token_data,
    loss=token_loss,
    items=lambda targets: targets.numel(),
    batch_size=12,
    steps=3,
    description="2-head attention with q/k RMSNorm over the hidden size, output projection, per-token head, (12, 8, 8)",
))


# VeOmni's pieces, on gloo.

def all_to_all_tensor(x, scatter_dim, gather_dim, group, async_op=False):
    """``_all_to_all``: split along ``scatter_dim``, exchange, concatenate along ``gather_dim``; with ``async_op``,
    a function that waits and returns the result."""
    chunks = torch.stack([t.contiguous() for t in torch.tensor_split(x, dist.get_world_size(group), scatter_dim)])
    output = torch.empty_like(chunks)
    work = dist.all_to_all_single(output, chunks, group=group, async_op=async_op)

    def wait():
        if work is not None:
            work.wait()
        return torch.cat(output.unbind(0), dim=gather_dim).contiguous()

    return wait if async_op else wait()


def rms_forward_affine(x, weight):
    invvar = torch.rsqrt(x.reshape(-1, FEATURES).pow(2).mean(-1) + EPS)
    return (x.reshape(-1, FEATURES) * invvar[:, None] * weight).reshape(x.shape), invvar


def rms_backward_affine(dout, invvar, x, weight):
    """The kernel's backward: ``dout`` and ``x`` read as rows of the hidden size, whatever their layout."""
    dout2, x2 = dout.reshape(-1, FEATURES), x.reshape(-1, FEATURES)
    xhat = x2 * invvar[:, None]
    g = dout2 * weight
    grad_input = invvar[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return grad_input.reshape(x.shape), (dout2 * xhat).sum(0)


def _linear_grads(grad, inputs, weight):
    """d(input), d(weight), d(bias) of F.linear, batch and sequence flattened."""
    grad2, inputs2 = grad.reshape(-1, grad.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
    return grad @ weight, grad2.T @ inputs2, grad2.sum(0)


class AsyncUlyssesQKVProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, norm_q_weight,
                norm_k_weight, group, as_reported):
        q = F.linear(hidden_states, q_weight, q_bias)
        output_q, invvar_q = rms_forward_affine(q, norm_q_weight)
        output_q_res = all_to_all_tensor(output_q, HEAD_DIM_AXIS, SEQ_DIM, group, async_op=True)
        k = F.linear(hidden_states, k_weight, k_bias)
        output_k, invvar_k = rms_forward_affine(k, norm_k_weight)
        output_k_res = all_to_all_tensor(output_k, HEAD_DIM_AXIS, SEQ_DIM, group, async_op=True)
        v = F.linear(hidden_states, v_weight, v_bias)
        v_res = all_to_all_tensor(v, HEAD_DIM_AXIS, SEQ_DIM, group, async_op=True)
        output_q, output_k, v = output_q_res(), output_k_res(), v_res()
        ctx.group, ctx.as_reported = group, as_reported
        ctx.save_for_backward(hidden_states, q_weight, k_weight, v_weight, q, norm_q_weight, invvar_q, k,
                              norm_k_weight, invvar_k)
        return output_q, output_k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        hidden_states, q_weight, k_weight, v_weight, q, norm_q_weight, invvar_q, k, norm_k_weight, invvar_k = (
            ctx.saved_tensors)
        group = ctx.group
        grad_v = all_to_all_tensor(grad_v.contiguous(), SEQ_DIM, HEAD_DIM_AXIS, group, async_op=True)()
        grad_k_res = all_to_all_tensor(grad_k.contiguous(), SEQ_DIM, HEAD_DIM_AXIS, group, async_op=True)
        grad_v_input, grad_v_weight, grad_v_bias = _linear_grads(grad_v, hidden_states, v_weight)
        if ctx.as_reported:  # k normalization backward on the uncollected gradient, then the collect overwrites it
            grad_k = grad_k.contiguous()
            _, grad_norm_k_weight = rms_backward_affine(grad_k, invvar_k, k, norm_k_weight)
            grad_k = grad_k_res()
        else:  # the fix: collect first, then the norm's backward
            grad_k = grad_k_res()
            grad_k, grad_norm_k_weight = rms_backward_affine(grad_k, invvar_k, k, norm_k_weight)
        grad_q_res = all_to_all_tensor(grad_q.contiguous(), SEQ_DIM, HEAD_DIM_AXIS, group, async_op=True)
        grad_k_input, grad_k_weight, grad_k_bias = _linear_grads(grad_k, hidden_states, k_weight)
        grad_q, grad_norm_q_weight = rms_backward_affine(grad_q_res(), invvar_q, q, norm_q_weight)
        grad_q_input, grad_q_weight, grad_q_bias = _linear_grads(grad_q, hidden_states, q_weight)
        return (grad_q_input + grad_k_input + grad_v_input, grad_q_weight, grad_q_bias, grad_k_weight, grad_k_bias,
                grad_v_weight, grad_v_bias, grad_norm_q_weight, grad_norm_k_weight, None, None)


class AsyncUlyssesOutputProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, proj_weight, proj_bias, group):
        hidden_states = all_to_all_tensor(hidden_states, SEQ_DIM, HEAD_DIM_AXIS, group)
        ctx.group = group
        ctx.save_for_backward(hidden_states, proj_weight)
        return F.linear(hidden_states, proj_weight, proj_bias)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, proj_weight = ctx.saved_tensors
        grad_o, grad_proj_weight, grad_proj_bias = _linear_grads(grad_output, hidden_states, proj_weight)
        grad_o = all_to_all_tensor(grad_o, HEAD_DIM_AXIS, SEQ_DIM, ctx.group, async_op=True)()
        return grad_o, grad_proj_weight, grad_proj_bias, None


def ulysses_attention(model, x):
    """This rank's chunk of the sequence in, its chunk of the attention block's output out."""
    q, k, v = AsyncUlyssesQKVProjection.apply(
        x, model.q_proj.weight, model.q_proj.bias, model.k_proj.weight, model.k_proj.bias, model.v_proj.weight,
        model.v_proj.bias, model.q_norm.weight, model.k_norm.weight, model.sp_group, model.backward_as_reported)
    return AsyncUlyssesOutputProjection.apply(attend(q, k, v), model.proj_o.weight, model.proj_o.bias, model.sp_group)


def ulysses(model, mesh):
    """The team's setup: Ulysses sequence parallelism over mesh['tp']."""
    model.sp_group = mesh["tp"].get_group()
    return model


def ulysses_as_reported(model, mesh):
    model = ulysses(model, mesh)
    model.backward_as_reported = True
    return model


def train_step(model, optimizer, batch):
    """Each rank keeps its chunk of every sequence; its loss is its tokens' sum over all tokens, and the replicated
    weights' gradients are summed over the sequence-parallel group (VeOmni's FSDP over dp x sp does that)."""
    inputs, targets = batch
    group, rank = model.sp_group, dist.get_rank(model.sp_group)
    chunk = inputs.shape[SEQ_DIM] // dist.get_world_size(group)
    mine = slice(rank * chunk, (rank + 1) * chunk)
    logits = model(inputs[:, mine])
    loss = F.cross_entropy(logits.reshape(-1, CLASSES), targets[:, mine].reshape(-1), reduction="sum")
    (loss / targets.numel()).backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad, group=group)
    optimizer.step()
    optimizer.zero_grad()
    whole = loss.detach().clone()
    dist.all_reduce(whole, group=group)
    return whole / targets.numel()


def buggy():
    return ec.check_step("field_ulysses_attention", train_step, mesh={"tp": 2}, parallelize=ulysses_as_reported)


def fixed():
    return ec.check_step("field_ulysses_attention", train_step, mesh={"tp": 2}, parallelize=ulysses)
