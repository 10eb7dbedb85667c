"""What the field's tensor-parallel adapter rows share: the tiny GPT of ``_tensor.py`` fine-tuned with LoRA, its base
frozen, and the Megatron form of its adapted layers as ``LoraParallelLinear`` lays out the factors.

On the column-parallel ``up`` the factor ``lora_a`` is replicated (every TP rank holds it whole) and ``lora_b`` is
column-parallel (``Shard(0)``, as the base's weight); on the row-parallel ``down``, ``lora_a`` is row-parallel
(``Shard(1)``) and ``lora_b`` replicated. Each adapter's output joins its base's in the base's parallel state. Under
sequence parallelism a replicated factor computes on this rank's chunk of the sequence (``up.lora_a`` on the
sequence-sharded input before the gather, ``down.lora_b`` after ``lora_a``'s reduce-scatter), so its gradient is a
partial sum: Megatron's gradient finalizer adds such gradients over the TP group only for parameters flagged
``sequence_parallel``. What trains: the four factors; the norms, the bases and the output layer are frozen.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import equivcheck as ec
from equivcheck_cases.field._tensor import (
    FEATURES, HIDDEN, CopyToTensorParallelRegion, GatherFromSequenceParallelRegion, GatherFromTensorParallelRegion,
    ReduceFromTensorParallelRegion, ReduceScatterToSequenceParallelRegion, ScatterToSequenceParallelRegion, TinyGPT,
    local, megatron_parallelize, output_layer, shard_, token_case)

RANK, ALPHA = 2, 4.0
SCALE = ALPHA / RANK


class Adapter(nn.Module):
    """One adapted layer's factors, drawn small and nonzero so both train from step 0."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.randn(RANK, features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(out, RANK) * 0.3)


class LoRAGPT(TinyGPT):
    """TinyGPT with its weights frozen and ``up`` and ``down`` adapted: ``base(x) + SCALE * x A^T B^T``."""

    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)
        self.up_adapter, self.down_adapter = Adapter(FEATURES, HIDDEN), Adapter(HIDDEN, FEATURES)
        # Where ``down``'s TP reduction is deferred (shared-expert overlap), what the adapter's whole delta is made
        # before it joins the base's partial output; None: the base reduces first and the delta is added after.
        self.join_partial = None
        # How ``up``'s replicated factor is applied in the Megatron form (a team's fused weight-gradient kernel).
        self.replicated_linear = plain_linear

    def forward(self, x):
        if self.tp_group is not None:  # Megatron's form: the block on [sequence, batch, hidden], this rank's chunk
            return output_layer(self, self.final_norm(self.after_block(lora_decoder(self, x))))
        normed = self.block_norm(x)
        inner = F.gelu(self.up(normed) + SCALE * normed @ self.up_adapter.lora_a.T @ self.up_adapter.lora_b.T)
        out = self.down(inner) + SCALE * inner @ self.down_adapter.lora_a.T @ self.down_adapter.lora_b.T
        return self.head(self.final_norm(self.after_block(x + out)))

    def after_block(self, hidden):
        """What runs between the block and the final norm: nothing here."""
        return hidden


def plain_linear(inputs, weight):
    return inputs @ weight.T


lora_gpt = ec.register_case(token_case(
    "field_lora_gpt", LoRAGPT,
    "TinyGPT frozen, LoRA (rank 2) on its up and down projections, over (12, 8, 8) tokens"))


def lora_parallelize(model, mesh, sequence_parallel=True, flag_replicated=True):
    """The model's Megatron form on ``mesh['tp']``: the base layers as ``_tensor.megatron_parallelize`` shards them,
    each adapter's TP-parallel factor sharded as its base, its replicated factor left whole; the norms and the
    replicated factors flagged ``sequence_parallel`` under SP, for the gradient finalizer (``flag_replicated=False``:
    the factors unflagged, as ``LoraParallelLinear`` built them before mcore-bridge pull #173)."""
    model = megatron_parallelize(model, mesh, sequence_parallel)
    shard_(model.up_adapter, "lora_b", mesh["tp"], 0)
    shard_(model.down_adapter, "lora_a", mesh["tp"], 1)
    replicated = [model.up_adapter.lora_a, model.down_adapter.lora_b]
    if hasattr(model, "mix_adapter"):  # the duplicated linear's adapter: both factors whole
        replicated += [model.mix_adapter.lora_a, model.mix_adapter.lora_b]
    for parameter in replicated:
        parameter.sequence_parallel = sequence_parallel and flag_replicated
    return model


def lora_decoder(model, x):
    """The adapted block on Megatron's [sequence, batch, hidden] activations: ``up``'s replicated ``lora_a`` on the
    rank's sequence chunk, its output gathered into the column-parallel ``lora_b``; ``down``'s row-parallel ``lora_a``
    reduce-scattered to the rank's chunk, where the replicated ``lora_b`` runs. Returns this rank's chunk under SP."""
    group, parallel = model.tp_group, model.sequence_parallel
    x = x.transpose(0, 1).contiguous()
    if parallel:
        x = ScatterToSequenceParallelRegion.apply(x, group)
    normed = model.block_norm(x)
    lora_in = model.replicated_linear(normed, model.up_adapter.lora_a)  # on this rank's chunk under SP
    if parallel:
        normed = GatherFromSequenceParallelRegion.apply(normed, group, True)
        lora_in = GatherFromSequenceParallelRegion.apply(lora_in, group, True)
    else:
        normed = CopyToTensorParallelRegion.apply(normed, group)
        lora_in = CopyToTensorParallelRegion.apply(lora_in, group)
    inner = F.gelu(F.linear(normed, local(model.up.weight), local(model.up.bias))
                   + SCALE * lora_in @ local(model.up_adapter.lora_b).T)
    partial = F.linear(inner, local(model.down.weight))
    lora_mid = inner @ local(model.down_adapter.lora_a).T  # row-parallel: a partial sum over the TP group
    reduce = ReduceScatterToSequenceParallelRegion if parallel else ReduceFromTensorParallelRegion
    lora_out = SCALE * reduce.apply(lora_mid, group) @ local(model.down_adapter.lora_b).T  # whole on every rank
    if model.join_partial is not None:  # the base's reduction deferred: the adapter's delta joins its partial output
        return x + reduce.apply(partial + model.join_partial(lora_out), group)
    return x + reduce.apply(partial, group) + lora_out



class MixAdapter(Adapter):
    """The duplicated linear's adapter, called as a module: ``SCALE * x A^T B^T`` on whatever tokens it is given; a
    ``lora_b`` sharded over TP (its output features) is gathered whole along the features, as a column-parallel
    adapter's output is."""

    def forward(self, x):
        delta = x @ local(self.lora_a).T @ local(self.lora_b).T
        if isinstance(self.lora_b, DTensor):
            delta = GatherFromTensorParallelRegion.apply(delta, self.lora_b.device_mesh.get_group())
        return SCALE * delta


class DuplicatedLoRAGPT(LoRAGPT):
    """LoRAGPT with a duplicated linear after its block, frozen and adapted too: the same whole weight on every TP
    rank, run under SP on the rank's own chunk of the sequence with no collective, as MLA's q/kv down-projections
    are. Its adapter's factors are whole on every rank (flagged ``sequence_parallel`` for the finalizer's sum), unless
    ``shard_duplicated_adapter`` shards its ``lora_b`` as a column-parallel adapter's."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(FEATURES, FEATURES).requires_grad_(False)
        self.mix_adapter = MixAdapter(FEATURES, FEATURES)

    def after_block(self, hidden):
        return hidden + self.mix(hidden) + self.mix_adapter(hidden)


duplicated_lora_gpt = ec.register_case(token_case(
    "field_duplicated_lora_gpt", DuplicatedLoRAGPT,
    "TinyGPT frozen with a duplicated linear after its block, LoRA (rank 2) on up, down and the duplicated linear, "
    "over (12, 8, 8) tokens"))
