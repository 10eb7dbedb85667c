"""What the field's FP8 rows share: Transformer Engine's delayed scaling written in plain PyTorch, a linear layer that
computes through it (with TE's weight cache across micro-batches), and the tensor rows' TinyGPT built of such layers,
in one process or Megatron-style tensor-parallel.

Transformer Engine needs CUDA; ``torch.float8_e4m3fn`` casts run on the CPU, so the rows re-create the recipe. Every
tensor an FP8 GEMM reads (a layer's input and its weight) has its own scaling state, a row of TE's ``FP8TensorMeta``:
a ``scale``, its inverse ``scale_inv`` and an amax history (``DelayedScaling``'s defaults: 1,024 entries,
``amax_compute_algo="max"``, margin 0). A cast multiplies the tensor by its ``scale``, saturates it to e4m3's +-448 and
rounds it to e4m3, and records the tensor's absolute maximum in the history's current slot; the GEMM reads the data
times ``scale_inv``. The scales are delayed: when ``fp8_autocast`` exits (the end of each forward in training), the
current slots of every meta are all-reduced with MAX over the ``fp8_group`` handed to it (TE's one buffer for all
of them), each new ``scale`` is ``448 / max(history)``, and the history rolls. So a cast uses the scale of the
iterations before it, and the first iteration casts at scale 1. The GEMM's gradient goes straight through the casts
(TE's wgrad and dgrad read the saved FP8 input and weight), here in the case's float64.

``Fp8Linear.is_first_microbatch`` is TE's argument as Megatron's ``TELinear`` passes it (``set_is_first_microbatch``
sets it before a step, the first forward clears it): None casts the weight at every forward; True casts it and keeps
the cast as the cache; False reuses the cache. ``cache_scale_inv`` says which ``scale_inv`` the reused cache is read
with: ``"own"``, the one it was cast with (a ``Float8Tensor`` keeps its own copy; TE 1.2.1's
``update_weight_scale_inv`` left the weight's alone after the first micro-batch), or ``"meta"``, the meta's current one.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from equivcheck_cases.field._tensor import (CopyToTensorParallelRegion, GatherFromTensorParallelRegion,
                                            ReduceFromTensorParallelRegion, TinyGPT, local)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: E4M3, TE's format for forward tensors
AMAX_HISTORY_LEN = 1024  # DelayedScaling's default (TE 1.x)
MARGIN = 0


class ScalingMeta:
    """One tensor's row of TE's FP8TensorMeta: scale 1, scale_inv 1 and a zeroed amax history to begin with."""

    def __init__(self, dtype):
        self.scale = torch.ones((), dtype=dtype)
        self.scale_inv = torch.ones((), dtype=dtype)
        self.amax_history = torch.zeros(AMAX_HISTORY_LEN, dtype=dtype)


def cast_to_fp8(tensor, meta):
    """TE's cast: ``tensor * scale`` saturated and rounded to E4M3; the tensor's amax recorded in the current slot
    (where training: a forward without gradients records nothing)."""
    tensor = tensor.detach()
    if torch.is_grad_enabled():
        meta.amax_history[0] = torch.maximum(meta.amax_history[0], tensor.abs().max())
    return (tensor * meta.scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def cast_from_fp8(data, scale_inv, dtype):
    return data.to(dtype) * scale_inv


class StraightThrough(torch.autograd.Function):
    """Forward: the dequantized FP8 tensor; backward: the gradient handed to the high-precision tensor it was cast
    from, as TE's GEMMs hand the master weight and the input their gradients."""

    @staticmethod
    def forward(ctx, tensor, dequantized):
        return dequantized.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fp8_metas(model):
    return [meta for module in model.modules() if isinstance(module, Fp8Linear)
            for meta in module.fp8_meta.values() if meta is not None]


def fp8_autocast_exit(model, fp8_group=None):
    """What leaving ``fp8_autocast`` does after a training forward (TE's ``reduce_and_update_fp8_tensors``): every
    meta's current amax all-reduced with MAX over ``fp8_group`` in one buffer, each scale recomputed from its history
    (``_default_sf_compute``: ``448 / amax / 2^margin``, kept where the amax is 0 or not finite), the history rolled."""
    if not torch.is_grad_enabled():
        return
    metas = fp8_metas(model)
    if not metas:
        return
    amaxes = torch.stack([meta.amax_history[0] for meta in metas])
    if fp8_group is not None and dist.get_world_size(fp8_group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=fp8_group)
    for meta, amax in zip(metas, amaxes):
        meta.amax_history[0] = amax
        amax = meta.amax_history.max()
        scale = (FP8_MAX / amax) / 2 ** MARGIN
        scale = torch.where((amax > 0) & torch.isfinite(amax), scale, meta.scale)
        meta.scale, meta.scale_inv = scale, 1.0 / scale
        meta.amax_history = torch.roll(meta.amax_history, -1, 0)
        meta.amax_history[0] = 0.0


class Fp8Linear(nn.Linear):
    """``te.pytorch.Linear`` in FP8 under delayed scaling: its input (where ``fp8_inputs``) and its weight cast with
    their own metas, the GEMM computed on what they read back. Under tensor parallelism it computes on this rank's
    shards (``local``), as a Megatron-style layer does. The weight cache follows ``is_first_microbatch`` and is read
    with ``cache_scale_inv`` (the module docstring)."""

    fp8_inputs = True
    cache_scale_inv = "own"

    def __init__(self, in_features, out_features, bias=True):
        super().__init__(in_features, out_features, bias=bias)
        self.fp8_meta = {"input": None, "weight": None}
        self.is_first_microbatch = None
        self.weight_fp8 = None  # the cache: FP8 data and the scale_inv it was cast with

    @classmethod
    def like(cls, linear):
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.load_state_dict(linear.state_dict())
        return layer

    def _meta(self, key, tensor):
        if self.fp8_meta[key] is None:
            self.fp8_meta[key] = ScalingMeta(tensor.dtype)
        return self.fp8_meta[key]

    def _weight(self, weight):
        meta = self._meta("weight", weight)
        first = self.is_first_microbatch
        if first is None or first or self.weight_fp8 is None:
            data = cast_to_fp8(weight, meta)
            if first is not None:
                self.weight_fp8 = (data, meta.scale_inv)
            scale_inv = meta.scale_inv
        else:
            data, own = self.weight_fp8
            scale_inv = own if self.cache_scale_inv == "own" else meta.scale_inv
        if first is not None:
            self.is_first_microbatch = False  # Megatron's TELinear clears it after its first forward
        return StraightThrough.apply(weight, cast_from_fp8(data, scale_inv, weight.dtype))

    def forward(self, input):
        weight = self._weight(local(self.weight))
        if self.fp8_inputs:
            meta = self._meta("input", input)
            input = StraightThrough.apply(input, cast_from_fp8(cast_to_fp8(input, meta), meta.scale_inv, input.dtype))
        return F.linear(input, weight, None if self.bias is None else local(self.bias))


def set_is_first_microbatch(model):
    """Megatron's ``model.set_is_first_microbatch()`` at the start of a step: every FP8 layer recasts its weight
    at its next forward and caches it for the micro-batches after."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.is_first_microbatch = True


class Fp8GPT(TinyGPT):
    """The tensor rows' TinyGPT with ``up``, ``down`` and ``head`` as FP8 layers, each forward ending as
    ``fp8_autocast`` ends (its amaxes reduced over ``fp8_group`` and its scales updated). Under
    ``_tensor.megatron_parallelize`` (without sequence parallelism) it runs Megatron's regions around the FP8 layers'
    own calls, each on this rank's shards."""

    def __init__(self, fp8_inputs=True, cache_scale_inv="own"):
        super().__init__()
        for name in ("up", "down", "head"):
            layer = Fp8Linear.like(getattr(self, name))
            layer.fp8_inputs, layer.cache_scale_inv = fp8_inputs, cache_scale_inv
            setattr(self, name, layer)
        self.fp8_group = None

    def forward(self, x):
        if self.tp_group is None:
            hidden = x + self.down(F.gelu(self.up(self.block_norm(x))))
            out = self.head(self.final_norm(hidden))
        else:
            out = self._megatron_forward(x)
        fp8_autocast_exit(self, self.fp8_group)
        return out

    def _megatron_forward(self, x):
        assert not self.sequence_parallel, "the FP8 rows run tensor parallelism without sequence parallelism"
        group = self.tp_group
        x = x.transpose(0, 1).contiguous()  # Megatron's [sequence, batch, hidden]
        normed = CopyToTensorParallelRegion.apply(self.block_norm(x), group)
        partial = self.down(F.gelu(self.up(normed)))
        hidden = self.final_norm(x + ReduceFromTensorParallelRegion.apply(partial, group))
        hidden = CopyToTensorParallelRegion.apply(hidden, group)
        return GatherFromTensorParallelRegion.apply(self.head(hidden), group).transpose(0, 1)
