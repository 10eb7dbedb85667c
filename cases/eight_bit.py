"""Quantised optimizer state, a precision policy: a blockwise 8-bit AdamW in plain PyTorch, as torchao's
``AdamW8bit`` and bitsandbytes' ``AdamW8bit`` keep their moments, and the choice each makes between 8-bit and
full-precision state by the size of the tensor it is handed. The field's 8-bit rows (pytorch/ao#4912,
bitsandbytes#2080) use it too.

The built-in cases train under it in every regime: ``adamw8bit_mlp`` decides each tensor's state on the logical
parameter's size, so a sharded regime quantises the same blocks as one process (equivalent under accumulation, DDP,
ZeRO and FSDP2); ``adamw8bit_local_size`` decides on the size of what the rank steps, as torchao did before pull
#4913, so FSDP2's half of the first weight keeps full-precision moments where one process keeps 8-bit ones.

The moments are quantised as the two libraries quantise them (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization"): the tensor flattened into blocks of ``BLOCK_SIZE`` elements, each block divided by its absolute
maximum (kept as the block's scale), and each scaled value rounded to the nearest of 256 levels of the dynamic map
(``create_dynamic_map``: signed for the first moment, unsigned for the second), its index stored as a ``uint8`` code.
A step dequantises both moments, updates them in the parameter's precision, stores them quantised again, and
updates the parameter from the unquantised values it just computed (torchao's ``single_param_adam``; bitsandbytes'
blockwise kernel does the same in one pass, its weight decay after the update). Only a tensor of
``MIN_8BIT_SIZE`` elements or more gets 8-bit state (torchao also asks for a whole number of blocks; bitsandbytes
pads the last one); a smaller one keeps its moments in the parameter's dtype. The cases run in float64, so "full precision" here is float64 where the teams' is
float32: the 8-bit moments differ from them by about 1% of their size, far above float64's tolerance.

The optimizer is DTensor-aware: a DTensor parameter (FSDP2's ``Shard(0)``) is stepped on its local shard, with its
local gradient. ``size_of`` says which size decides the state: ``"local"``, the shard's, as torchao's
``_new_buffer`` decided before pytorch/ao pull #4913, and as bitsandbytes decides for whatever tensor it is handed
(an FSDP1 flat shard); ``"global"``, the logical parameter's, as #4913 decides, allocating the state on the local
shard and refusing a shard whose blocks are not the parameter's own.
"""

import dataclasses
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import equivcheck as ec

BLOCK_SIZE = 256  # torchao's AdamW8bit default and bitsandbytes' blockwise optimizers' block
MIN_8BIT_SIZE = 4096  # "follow bitsandbytes, only quantize tensors >= 4096 values" (torchao); bnb's min_8bit_size


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """The dynamic quantisation map of bitsandbytes (``functional.create_dynamic_map``, which torchao copies): a
    dynamic exponent and fraction, 256 sorted levels in [-1, 1] (signed) or [0, 1] (unsigned), in float32."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


class State8bit:
    """One moment of one tensor in 8 bits: a ``uint8`` code per element, a scale (absmax) per block of the flattened
    tensor (the last block zero-padded where the size is no whole number of blocks, as bitsandbytes counts its
    blocks), and the map."""

    def __init__(self, like, signed, block_size=BLOCK_SIZE):
        self.shape, self.numel, self.block_size = like.shape, like.numel(), block_size
        self.blocks = -(-self.numel // block_size)
        self.codes = torch.zeros(self.blocks * block_size, dtype=torch.uint8, device=like.device)
        self.scale = torch.zeros(self.blocks, dtype=like.dtype, device=like.device)
        self.qmap = create_dynamic_map(signed).to(device=like.device, dtype=like.dtype)

    def dequantize(self):
        values = self.qmap[self.codes.long()].view(self.blocks, self.block_size) * self.scale.view(-1, 1)
        return values.reshape(-1)[:self.numel].view(self.shape)

    def store(self, values):
        """Quantise ``values``: each block scaled by its absmax, each element rounded to the nearest level."""
        flat = values.reshape(-1)
        blocks = torch.cat([flat, flat.new_zeros(self.blocks * self.block_size - self.numel)]).view(self.blocks, -1)
        scale = blocks.abs().amax(-1).clip(1e-12)
        scaled = (blocks / scale.view(-1, 1)).reshape(-1)
        below = (torch.searchsorted(self.qmap, scaled, right=True) - 1).clamp(0, 254)
        low, high = self.qmap[below], self.qmap[below + 1]
        codes = torch.where(scaled - low >= (high - low) * 0.5, below + 1, below)
        self.codes.copy_(codes.to(torch.uint8))
        self.scale.copy_(scale)


def new_moment(like, signed, eight_bit, block_size=BLOCK_SIZE):
    """A zero moment shaped as ``like``: 8-bit where ``eight_bit``, else in ``like``'s dtype."""
    return State8bit(like, signed, block_size) if eight_bit else Moment(like)


class Moment:
    """A moment kept in the tensor's own dtype (a tensor too small for 8-bit state)."""

    def __init__(self, like):
        self.values = torch.zeros_like(like)

    def dequantize(self):
        return self.values

    def store(self, values):
        self.values.copy_(values)


def eight_bit_eligible(numel, min_8bit_size=MIN_8BIT_SIZE, block_size=BLOCK_SIZE, whole_blocks=True):
    """The libraries' threshold: ``min_8bit_size`` elements or more (and, for torchao, a whole number of blocks)."""
    return numel >= min_8bit_size and (not whole_blocks or numel % block_size == 0)


def global_layout_is_blockwise(p, block_size):
    """#4913's guard for a parameter newly eligible by its global size: replicated or sharded on dimension 0 only,
    and every local shard a whole, non-empty number of blocks (so its blocks are the parameter's own)."""
    local = p.to_local()
    if local.numel() == 0 or local.numel() % block_size:
        return False
    return all(isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)
               for placement in p.placements)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with blockwise 8-bit moments for tensors of ``min_8bit_size`` elements or more. ``size_of``: whose
    numel decides (``"local"``: the tensor stepped on, a DTensor's local shard; ``"global"``: the logical
    parameter's). ``whole_blocks``: only a tensor of whole blocks is eligible (torchao; bitsandbytes pads the last
    block instead). ``decay_after``: the weight decay applied after the Adam update (bitsandbytes' kernel), else
    before it (torchao)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, block_size=BLOCK_SIZE,
                 min_8bit_size=MIN_8BIT_SIZE, size_of="global", whole_blocks=True, decay_after=False):
        if size_of not in ("local", "global"):
            raise ValueError(f"size_of={size_of!r}: 'local' or 'global'")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size, self.min_8bit_size = block_size, min_8bit_size
        self.size_of, self.whole_blocks, self.decay_after = size_of, whole_blocks, decay_after

    def eight_bit(self, p):
        """Whether ``p`` gets 8-bit state, decided on the size ``size_of`` names."""
        local = p.to_local() if isinstance(p, DTensor) else p
        decided_on = p if self.size_of == "global" else local  # a DTensor's numel is the global parameter's
        eligible = eight_bit_eligible(decided_on.numel(), self.min_8bit_size, self.block_size, self.whole_blocks)
        if eligible and isinstance(p, DTensor) and local.numel() < self.min_8bit_size \
                and not global_layout_is_blockwise(p, self.block_size):
            raise ValueError(f"a {tuple(p.shape)} parameter placed {p.placements}: its local shard of "
                             f"{local.numel()} elements does not keep whole {self.block_size}-element blocks")
        return eligible

    def new_moment(self, p, signed):
        local = p.to_local() if isinstance(p, DTensor) else p
        return new_moment(local, signed, self.eight_bit(p), self.block_size)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                param = p.to_local() if isinstance(p, DTensor) else p
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = self.new_moment(p, signed=True)
                    state["exp_avg_sq"] = self.new_moment(p, signed=False)
                state["step"] += 1
                adamw_update(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, beta1, beta2,
                             eps, weight_decay, self.decay_after)


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decay_after=False):
    """torchao's ``single_param_adam`` (AdamW) in the parameter's dtype: the moments dequantised, updated, stored
    quantised again, and the parameter updated from the unquantised values."""
    value = param.clone()
    if not decay_after:
        value = value - lr * weight_decay * value
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    m = exp_avg.dequantize().lerp(grad, 1 - beta1)
    v = exp_avg_sq.dequantize().lerp(grad.square(), 1 - beta2)
    exp_avg.store(m)
    exp_avg_sq.store(v)
    value = value - lr * (m / bias_correction1) / (v.sqrt() / math.sqrt(bias_correction2) + eps)
    if decay_after:
        value = value * (1 - lr * weight_decay)
    param.copy_(value)


def model():
    """A 512-12-3 classifier: its first weight, 6,144 elements (24 blocks), takes 8-bit state; FSDP2's half of it on
    each of two ranks, 3,072, is under the threshold; every other tensor keeps full-precision moments."""
    return nn.Sequential(nn.Linear(512, 12), nn.Tanh(), nn.Linear(12, 3))


def data():
    return torch.randn(24, 512), torch.randint(0, 3, (24,))


adamw8bit_mlp = ec.register_case(ec.Case(
    name="adamw8bit_mlp",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=8,
    steps=3,
    optimizer=partial(AdamW8bit, lr=1e-2),
    regimes=("full_batch", "accumulate:chunks=4", "ddp:world_size=2", "zero:world_size=2", "fsdp:world_size=2"),
    description="quantised optimizer state: blockwise 8-bit AdamW moments, chosen on each parameter's logical size",
))

adamw8bit_local_size = ec.register_case(dataclasses.replace(
    adamw8bit_mlp,
    name="adamw8bit_local_size",
    optimizer=partial(AdamW8bit, lr=1e-2, size_of="local"),
    regimes=("full_batch", "accumulate:chunks=4", "fsdp:world_size=2"),
    expect_mismatch={"fsdp": "8-bit state chosen on the rank's shard: FSDP2's half of 0.weight keeps full-precision "
                             "moments where one process quantises them"},
    description="pitfall: 8-bit or full-precision optimizer state chosen on the size of the rank's shard",
))
