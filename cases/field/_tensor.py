"""What the field's tensor-parallel rows share: Megatron's communication mappings on raw collectives, the small
models those rows' teams parallelise (a tiny GPT run tensor- and sequence-parallel Megatron-style, torchtitan's MoE
layer with its parallel styles, an attention block with learnable sinks) and Megatron's clip by the global norm,
with the one-process reference a clipping team is held to.

A team's own Megatron-style layer keeps a plain local shard and runs its collectives by hand. Here the sharded
weights are DTensors (``shard_``: ``distribute_tensor`` with ``Shard(dim)`` over the mesh's ``tp`` dimension) and the
layers' math runs on ``.to_local()``: autograd hands each local gradient back as the shard's, and equivcheck reads the
full weights and gradients through ``full_tensor()``. Parameters every TP rank holds whole (norms, replicated
projections, heads) stay plain tensors: equivcheck takes them as replicated, and ranks whose copies drift apart are
a finding of their own.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput, parallelize_module

import equivcheck as ec

FEATURES, HIDDEN, CLASSES, SEQUENCE = 8, 16, 4, 8


def shard_(module, name, mesh, dim):
    """``module.name`` as a DTensor parameter sharded along ``dim`` over ``mesh`` (a TP layer's local shard)."""
    full = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(dim)]),
                                                 requires_grad=full.requires_grad))


def local(parameter):
    """What a Megatron-style layer computes with: this rank's shard of a sharded weight, a replicated one whole."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


# Megatron-LM's mappings (megatron/core/tensor_parallel/mappings.py), on gloo. Sequence-parallel regions split the
# first dimension: Megatron's activations are [sequence, batch, hidden].

# Megatron's all_gather_into_tensor and reduce_scatter_tensor are all_gather_single and reduce_scatter_single from
# torch 2.13 on (the old names warn in 2.13); torch 2.11 has only the old names. The rows call whichever this torch has.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

def _reduce(input_, group):
    """All-reduce across the TP group, as Megatron wrote it: the collective runs on ``input_.contiguous()`` and
    ``input_`` is returned (a non-contiguous input is reduced in a copy that is dropped)."""
    if dist.get_world_size(group) == 1:
        return input_
    dist.all_reduce(input_.contiguous(), group=group)
    return input_


def _split_first(input_, group):
    size = input_.shape[0] // dist.get_world_size(group)
    start = dist.get_rank(group) * size
    return input_[start:start + size].contiguous()


def _gather_first(input_, group):
    output = input_.new_empty((input_.shape[0] * dist.get_world_size(group), *input_.shape[1:]))
    _all_gather_single(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_first(input_, group):
    output = input_.new_empty((input_.shape[0] // dist.get_world_size(group), *input_.shape[1:]))
    _reduce_scatter_single(output, input_.contiguous(), group=group)
    return output


def _gather_last(input_, group):
    return _gather_first(input_.movedim(-1, 0), group).movedim(0, -1)


def _split_last(input_, group):
    return _split_first(input_.movedim(-1, 0), group).movedim(0, -1).contiguous()


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity; backward: all-reduce (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (the output of a row-parallel layer); backward: identity."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_.clone(), group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence; backward: all-gather it."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_first(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_first(grad_output, ctx.group), None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence; backward: reduce-scatter it where the region after the gather is tensor
    parallel (each rank's gradient a partial sum), else keep this rank's chunk."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad=True):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return _gather_first(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad_output, ctx.group), None, None
        return _split_first(grad_output, ctx.group), None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence (the output of a row-parallel layer under SP); backward: gather."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_first(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_first(grad_output, ctx.group), None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dimension (a column-parallel output made whole); backward: keep this
    rank's slice."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last(grad_output, ctx.group), None


# A tiny GPT: x + down(gelu(up(block_norm(x)))), then final_norm and the output layer, per token.

class TinyGPT(nn.Module):
    """One pre-norm MLP block with its residual, a final norm and an output layer over per-token classes. Built
    plain (one process); ``megatron_parallelize`` turns it into its Megatron form, which runs ``megatron_forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.block_norm = nn.LayerNorm(FEATURES)
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES, bias=False)
        self.final_norm = nn.LayerNorm(FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES, bias=False)
        self.tp_group = None
        self.sequence_parallel = False
        with torch.no_grad():  # trained norms, not the ones and zeros they start from: their gradients matter
            for norm in (self.block_norm, self.final_norm):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        if self.tp_group is not None:
            return megatron_forward(self, x)
        hidden = x + self.down(F.gelu(self.up(self.block_norm(x))))
        return self.head(self.final_norm(hidden))


def megatron_parallelize(model, mesh, sequence_parallel=True):
    """Megatron's layers on the mesh's ``tp`` dimension: ``up`` column-parallel (weight and bias Shard(0)), ``down``
    row-parallel (weight Shard(1); it has no bias), the output layer column-parallel over the classes; under sequence
    parallelism the norms see this rank's chunk of the sequence, and Megatron marks their parameters
    ``sequence_parallel`` for its gradient finalizer (``_allreduce_layernorm_grads``)."""
    tp = mesh["tp"]
    shard_(model.up, "weight", tp, 0)
    shard_(model.up, "bias", tp, 0)
    shard_(model.down, "weight", tp, 1)
    shard_(model.head, "weight", tp, 0)
    model.tp_group = tp.get_group()
    model.sequence_parallel = sequence_parallel
    for parameter in (*model.block_norm.parameters(), *model.final_norm.parameters()):
        parameter.sequence_parallel = sequence_parallel
    return model


def decoder(model, x):
    """The block on Megatron's [sequence, batch, hidden] activations: sequence-sharded around the norms under SP,
    the MLP column- then row-parallel. Returns the block's output, this rank's chunk of the sequence under SP."""
    group = model.tp_group
    x = x.transpose(0, 1).contiguous()
    if model.sequence_parallel:
        x = ScatterToSequenceParallelRegion.apply(x, group)
    normed = model.block_norm(x)
    if model.sequence_parallel:
        normed = GatherFromSequenceParallelRegion.apply(normed, group, True)
    else:
        normed = CopyToTensorParallelRegion.apply(normed, group)
    inner = F.gelu(F.linear(normed, local(model.up.weight), local(model.up.bias)))
    partial = F.linear(inner, local(model.down.weight))
    if model.sequence_parallel:
        out = ReduceScatterToSequenceParallelRegion.apply(partial, group)
    else:
        out = ReduceFromTensorParallelRegion.apply(partial, group)
    return x + out


def output_layer(model, hidden):
    """The column-parallel output layer: the final norm's output gathered from the sequence-parallel region (or
    copied into the tensor-parallel one), this rank's classes computed, the logits gathered whole, as [batch,
    sequence, classes]."""
    group = model.tp_group
    if model.sequence_parallel:
        hidden = GatherFromSequenceParallelRegion.apply(hidden, group, True)
    else:
        hidden = CopyToTensorParallelRegion.apply(hidden, group)
    logits = GatherFromTensorParallelRegion.apply(F.linear(hidden, local(model.head.weight)), group)
    return logits.transpose(0, 1)


def megatron_forward(model, x):
    return output_layer(model, model.final_norm(decoder(model, x)))


def token_loss(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="none")


def token_data():
    return torch.randn(36, SEQUENCE, FEATURES), torch.randint(0, CLASSES, (36, SEQUENCE))


def plain_sgd(parameters):
    """The case's SGD with momentum, one tensor at a time: a Megatron-style model mixes DTensor shards with plain
    replicated tensors, which one foreach kernel call does not take."""
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9, foreach=False)


def token_case(name: str, model, description: str) -> ec.Case:
    """The tensor rows' case shape: 3 steps of 12 sequences of 8 tokens, a loss per token, SGD one tensor at a time.
    The row's own module registers it (``ec.register_case``): ranks import the case from where it was registered."""
    return ec.Case(name=name, model=model, data=token_data, loss=token_loss, items=lambda targets: targets.numel(),
                   optimizer=plain_sgd, batch_size=12, steps=3, description=description)


tiny_gpt = ec.register_case(token_case(
    "field_tiny_gpt", TinyGPT,
    "pre-norm MLP block, final norm and output layer over (12, 8, 8) tokens, 4 classes per token"))


def token_mean(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# A tiny MoE layer as torchtitan writes it (torchtitan/models/moe/moe.py: TokenChoiceTopKRouter, GroupedExperts with
# the for-loop experts, the reorderer), between an input projection and a per-token head.

EXPERTS, TOP_K, EXPERT_HIDDEN = 2, 1, 8


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    outputs = []
    for expert, tokens in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
        h = F.silu(tokens @ w1[expert].transpose(-2, -1)) * (tokens @ w3[expert].transpose(-2, -1))
        outputs.append(h @ w2[expert].transpose(-2, -1))
    return torch.cat(outputs, dim=0)


class GroupedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, EXPERT_HIDDEN, FEATURES) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, FEATURES, EXPERT_HIDDEN) * 0.3)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, EXPERT_HIDDEN, FEATURES) * 0.3)

    def forward(self, x, num_tokens_per_expert):
        # torchtitan: "Convert parameters from DTensors to plain Tensors, to work with dynamic-shape inputs"
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(FEATURES, EXPERTS, bias=False)

    def forward(self, x):
        scores = F.softmax(self.gate(x), dim=1)
        top_scores, selected_experts_indices = torch.topk(scores, k=TOP_K, dim=1)
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).double(), bins=EXPERTS, min=0,
                                            max=EXPERTS).long()
        return top_scores, selected_experts_indices, num_tokens_per_expert


class MoE(nn.Module):
    def __init__(self, score_before_experts=True) -> None:
        super().__init__()
        self.router = TokenChoiceTopKRouter()
        self.experts = GroupedExperts()
        self.score_before_experts = score_before_experts

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        routed_input = x[token_indices_experts_sorted // TOP_K]
        if self.score_before_experts:
            routed_input = routed_input * top_scores_experts_sorted.reshape(-1, 1)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        routed_output_unsorted = torch.zeros((bs * slen * TOP_K, dim), dtype=routed_output.dtype)
        routed_output_unsorted[token_indices_experts_sorted] = routed_output
        routed_output_unsorted = routed_output_unsorted.reshape(-1, TOP_K, dim)
        if not self.score_before_experts:
            out = torch.bmm(top_scores.reshape(-1, 1, TOP_K), routed_output_unsorted).squeeze(1)
        else:
            out = routed_output_unsorted.sum(dim=1)
        return out.reshape(bs, slen, dim)


class MoEModel(nn.Module):
    """An input projection, the MoE layer with its residual, a per-token head."""

    def __init__(self, score_before_experts=True) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, FEATURES)
        self.moe = MoE(score_before_experts)
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        return self.head(h + self.moe(h))


def moe_case(name, score_before_experts):
    return ec.register_case(token_case(
        name, lambda: MoEModel(score_before_experts),
        f"input projection, a top-{TOP_K} MoE of {EXPERTS} SwiGLU experts (scores applied "
        f"{'before' if score_before_experts else 'after'} the experts), per-token head, (12, 8, 8)"))


moe_scores_before = moe_case("field_moe_scores_before", score_before_experts=True)
moe_scores_after = moe_case("field_moe_scores_after", score_before_experts=False)


def token_mean_step(model, optimizer, batch):
    """A plain step: the global batch's mean token loss, one backward, one optimizer step."""
    inputs, targets = batch
    loss = token_mean(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


# torchtitan's parallel styles for the MoE layer (torchtitan/distributed/__init__.py NoParallel,
# torchtitan/distributed/expert_parallel.py TensorParallel) and its plan for a block's MoE (apply_moe_ep_tp, no EP).

class NoParallel(ParallelStyle):
    """Replicated computation on the router's gate: its parameters Replicate DTensors, its input made a DTensor and
    its output made local again; ``local_output_grad_placements`` (pytorch/torchtitan#2387's one-line annotation, a
    parameter as pull #2416 names it) says what the local output's gradient is (None: taken as Replicate)."""

    def __init__(self, local_output_grad_placements=None):
        super().__init__()
        self.local_output_grad_placements = local_output_grad_placements

    def _prepare_input_fn(self, mod, inputs, device_mesh):
        input_tensor = inputs[0]
        if not isinstance(input_tensor, DTensor):
            input_tensor = DTensor.from_local(input_tensor, device_mesh, (Replicate(),), run_check=False)
        return (input_tensor, *inputs[1:])

    def _prepare_output_fn(self, mod, outputs, device_mesh):
        if outputs.placements != (Replicate(),):
            outputs = outputs.redistribute(placements=(Replicate(),))
        return outputs.to_local(grad_placements=self.local_output_grad_placements)

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, None, self._prepare_input_fn, self._prepare_output_fn)


class TensorParallel(ParallelStyle):
    """Tensor parallelism for GroupedExperts: w1 and w3 column-wise (Shard(1)), w2 row-wise (Shard(2)). With
    ``partial_input_grad`` (torchtitan pull #1878) the routed input's gradient is marked Partial, so it is summed over
    the TP group in backward."""

    def __init__(self, partial_input_grad=True):
        super().__init__()
        self.partial_input_grad = partial_input_grad

    def _prepare_input_fn(self, mod, inputs, device_mesh):
        routed_input, num_tokens_per_expert = inputs
        routed_input = DTensor.from_local(routed_input, device_mesh, (Replicate(),)).to_local(
            grad_placements=(Partial(),))
        return routed_input, num_tokens_per_expert

    def _partition_fn(self, name, module, device_mesh):
        for weight, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            module.register_parameter(weight, nn.Parameter(distribute_tensor(getattr(module, weight), device_mesh,
                                                                             [Shard(dim)])))

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, self._partition_fn,
                                 self._prepare_input_fn if self.partial_input_grad else None)


def moe_tensor_parallel(model, mesh, experts_plan, router_plan):
    """torchtitan's apply_moe_ep_tp without EP or SP: the MoE's input Replicate and made local, its output Partial
    (the row-wise experts' partial sums) all-reduced to Replicate; the router's gate replicated; the experts TP."""
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "moe": PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Partial(),),
                                        desired_output_layouts=(Replicate(),)),
        "moe.router.gate": router_plan,
    })
    parallelize_module(model.moe.experts, tp, experts_plan)
    return model


# An attention block with learnable attention sinks (gpt-oss style, Megatron's softmax_type="learnable") behind a
# replicated ("duplicated") input projection, and Megatron's gradient clipping by the global norm.

HEADS, HEAD_DIM = 2, FEATURES // 2


class SinkAttention(nn.Module):
    """x -> down_proj (replicated) -> qkv (column-parallel, rows grouped by head) -> attention whose softmax has one
    learnable sink logit per head (``softmax_offset``) -> proj (row-parallel) -> per-token head."""

    def __init__(self) -> None:
        super().__init__()
        self.down_proj = nn.Linear(FEATURES, FEATURES, bias=False)
        self.qkv = nn.Linear(FEATURES, 3 * FEATURES, bias=False)
        self.softmax_offset = nn.Parameter(torch.empty(HEADS))
        self.proj = nn.Linear(FEATURES, FEATURES, bias=False)
        self.head = nn.Linear(FEATURES, CLASSES)
        self.tp_group = None
        with torch.no_grad():  # attention that matters next to the head: its gradients a real share of the norm
            for weight in (self.qkv.weight, self.proj.weight, self.head.weight):
                weight.mul_(3)
            self.softmax_offset.uniform_(0.5, 1.5)

    def attend(self, qkv, offset):
        """Attention over the heads ``qkv`` holds ([b, s, heads * 3 * head_dim], grouped by head)."""
        q, k, v = qkv.unflatten(-1, (-1, 3, HEAD_DIM)).permute(3, 0, 2, 1, 4).unbind(0)  # each [b, h, s, d]
        scores = q @ k.transpose(-2, -1) / HEAD_DIM ** 0.5
        sink = offset.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return (probs @ v).transpose(1, 2).flatten(-2)

    def forward(self, x):
        h = self.down_proj(x)
        if self.tp_group is None:
            mixed = self.proj(self.attend(self.qkv(h), self.softmax_offset))
        else:
            qkv = F.linear(CopyToTensorParallelRegion.apply(h, self.tp_group), local(self.qkv.weight))
            partial = F.linear(self.attend(qkv, local(self.softmax_offset)), local(self.proj.weight))
            mixed = ReduceFromTensorParallelRegion.apply(partial, self.tp_group)
        return self.head(mixed)


sink_attention = ec.register_case(token_case(
    "field_sink_attention", SinkAttention,
    "replicated input projection, 2-head attention with learnable sinks (qkv column-, proj row-parallel "
    "under TP), per-token head, (12, 8, 8)"))


def sink_attention_tensor_parallel(model, mesh, sink_marked=True, down_proj_marked=False):
    """Megatron's layers on mesh['tp']: qkv Shard(0) (each rank its head), proj Shard(1), the sinks Shard(0) with
    their heads; ``tensor_model_parallel`` set as the layers set it (``sink_marked``: DotProductAttention marks its
    learnable ``softmax_offset``; ``down_proj_marked``: a Transformer Engine Linear marks even a replicated weight)."""
    tp = mesh["tp"]
    shard_(model.qkv, "weight", tp, 0)
    shard_(model.proj, "weight", tp, 1)
    shard_(model, "softmax_offset", tp, 0)
    model.qkv.weight.tensor_model_parallel = True
    model.proj.weight.tensor_model_parallel = True
    model.softmax_offset.tensor_model_parallel = sink_marked
    model.down_proj.weight.tensor_model_parallel = down_proj_marked
    model.tp_group = tp.get_group()
    return model


def megatron_clip_grad_norm(parameters, max_norm, group):
    """Megatron's ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``: the squares of this rank's gradients
    that count (``param_is_not_tensor_parallel_duplicate``: a parameter marked ``tensor_model_parallel`` on every
    rank, any other on TP rank 0 only), summed over the model-parallel group; every gradient scaled by
    ``max_norm / (norm + 1e-6)`` where that is below 1."""
    parameters = [p for p in parameters if p.grad is not None]
    counted = [p for p in parameters if getattr(p, "tensor_model_parallel", False) or dist.get_rank(group) == 0]
    total = torch.zeros((), dtype=torch.float64)
    for p in counted:
        total += local(p.grad).pow(2).sum()
    dist.all_reduce(total, group=group)
    coefficient = max_norm / (total.sqrt() + 1e-6)
    if coefficient < 1:
        for p in parameters:
            local(p.grad).mul_(coefficient)
    return total.sqrt()


def clipped_token_step(max_norm):
    """One process's training of what a clipping team means: the global batch's mean token loss, its whole gradient
    clipped once to ``max_norm``, one step. Bind it at a module's top level."""

    def clipped_full_batch(model, optimizer, batch):
        inputs, targets = batch
        loss = token_mean(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return clipped_full_batch


def token_step(model, optimizer, batch, after_backward=lambda model: None):
    """The rows' team step: the mean token loss, backward, then what the team does to the gradients before stepping
    (Megatron's ``finalize_model_grads``, its clip), one optimizer step."""
    inputs, targets = batch
    loss = token_mean(model(inputs), targets)
    loss.backward()
    after_backward(model)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def megatron_clipped_step(model, optimizer, batch, max_norm):
    """The team's step: the mean token loss, backward, Megatron's clip over the TP group, one step."""
    return token_step(model, optimizer, batch,
                      lambda model: megatron_clip_grad_norm(model.parameters(), max_norm, model.tp_group))


# Megatron's vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py) and a TinyGPT whose output
# layer keeps its logits vocab-parallel (``parallel_output=True``): each TP rank returns its own slice of the classes.

class VocabParallelCrossEntropy(torch.autograd.Function):
    """``_VocabParallelCrossEntropy`` on [sequence or batch, ..., local vocab] logits: the global max, the target's
    logit and the sum of exponentials all-reduced over ``group``; a custom backward (softmax minus the target) that
    keeps every shard's softmax gradient. With ``label_smoothing`` the target distribution puts ``1 - alpha`` on the
    target and ``alpha / (V - 1)`` on every other class. ``global_smoothing=False`` is Megatron as it was (NVIDIA/
    Megatron-LM#7464): V is the local partition's size and the mean log-probability is the local slice's;
    ``True`` is the fix of pull #7466, the shifted logits' sum all-reduced and V the whole vocabulary."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing=0.0, global_smoothing=True):
        logits_max = vocab_parallel_logits.max(dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)
        partition_vocab_size = shifted.size(-1)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        vocab_start = rank * partition_vocab_size
        target_mask = (target < vocab_start) | (target >= vocab_start + partition_vocab_size)
        masked_target = (target - vocab_start).masked_fill(target_mask, 0)
        predicted_logits = shifted.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
        exp_logits = shifted.exp()
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(predicted_logits, group=group)
        dist.all_reduce(sum_exp_logits, group=group)
        loss = sum_exp_logits.log() - predicted_logits
        softmax = exp_logits / sum_exp_logits.unsqueeze(-1)
        vocab_size = partition_vocab_size * world if global_smoothing else partition_vocab_size
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            if global_smoothing:  # pull #7466: the global mean log-probability, from the shifted logits' global sum
                shifted_sum = shifted.sum(dim=-1)
                dist.all_reduce(shifted_sum, group=group)
                mean_log_probs = shifted_sum / vocab_size - sum_exp_logits.log()
            else:  # as reported: the mean of this rank's slice of the log-probabilities
                mean_log_probs = softmax.log().mean(dim=-1)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target = ctx.saved_tensors
        grad_input = softmax.clone()
        update = (1.0 - target_mask.to(softmax.dtype)).unsqueeze(-1)
        one_hot = torch.zeros_like(softmax).scatter_(-1, masked_target.unsqueeze(-1), 1.0)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            grad_input -= (1.0 - smoothing) * update * one_hot
            grad_input -= smoothing / ctx.vocab_size
        else:
            grad_input -= update * one_hot
        return grad_input * grad_output.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, group, label_smoothing=0.0, global_smoothing=True):
    return VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, label_smoothing, global_smoothing)


class VocabParallelGPT(TinyGPT):
    """TinyGPT whose Megatron form returns its output layer's logits unsplit from the classes it holds
    (``parallel_output=True``): [batch, sequence, classes / TP] on each rank; in one process, all the classes."""

    def forward(self, x):
        if self.tp_group is None:
            return super().forward(x)
        hidden = CopyToTensorParallelRegion.apply(self.final_norm(decoder(self, x)), self.tp_group)
        return F.linear(hidden, local(self.head.weight)).transpose(0, 1)


vocab_parallel_gpt = ec.register_case(token_case(
    "field_vocab_parallel_gpt", VocabParallelGPT,
    "pre-norm MLP block, final norm and an output layer whose logits stay vocab-parallel under TP, (12, 8, 8) "
    "tokens, 4 classes per token"))


def vocab_parallel(model, mesh):
    """Megatron's layers on mesh['tp'] without sequence parallelism, the output layer's logits left split."""
    return megatron_parallelize(model, mesh, sequence_parallel=False)
