"""linkedin/Liger-Kernel#830: fused linear cross entropy summed the lm_head's weight gradient chunk by chunk in bf16.

Liger's fused linear cross entropy never holds the whole logits: it cuts the tokens into chunks (the chunk size the
next power of two of the tokens over ``ceil(V / H)``), and for each chunk computes the logits, the loss and their
gradient, the input's gradient rows, and adds ``grad_logits_chunk.T @ input_chunk`` into ``grad_weight``. That buffer
was allocated like the weight, so with a bf16 lm_head every chunk's sum was rounded to bfloat16 again, and the
weight gradient collected one rounding per chunk where the unfused layer (one matmul, accumulated in fp32, rounded
once) has one; the pull links reports #512 and #827 of worse or divergent training with it. The pull, still open,
adds ``accum_dtype`` so that the buffer can be fp32 and cast to the weight's dtype once at the end. Here a small
token model (an 8-wide tanh trunk and a 64-class output layer, so 96 tokens go in 6 chunks of 16) trains in one
process, its output layer's gradient held in bfloat16 as a bf16 lm_head's is, and the team's step feeds the trunk's
output and the layer's weight to the fused loss, as Liger's patched forward does, against the unfused model, where
that gradient is rounded once.
As reported the buffer is rounded to bfloat16 after every chunk and the gradient parts from the first step by
bfloat16 ulps; as fixed it is accumulated in the case's float64 (fp32's role) and rounded once, as the model's is.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("linkedin/Liger-Kernel", "pull", 830, "precision",
          "fused linear cross entropy accumulated the lm_head weight gradient chunk by chunk in bf16",
          fixed_by="open; accum_dtype=float32, the weight gradient rounded to the weight's dtype once",
          fix_acts="backward head")

FEATURES, HIDDEN, VOCAB, SEQUENCE = 8, 8, 64, 8


def bf16(x):
    """``x`` on bfloat16's grid: what a bfloat16 tensor holds of it."""
    return x.to(torch.bfloat16).to(x.dtype)


class TokenModel(nn.Module):
    """A per-token trunk and an lm_head whose gradient is stored in bfloat16 (a bf16 parameter's)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight.register_hook(bf16)

    def forward(self, x):
        return self.head(self.trunk(x))


def data():
    return torch.randn(36, SEQUENCE, FEATURES), torch.randint(0, VOCAB, (36, SEQUENCE))


TOKENS = ec.register_case(ec.Case(
    name="field_liger_flce", model=TokenModel, data=data,
    loss=lambda logits, y: F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none"),
    items=lambda targets: targets.numel(), batch_size=12, steps=3,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    description="8-wide tanh trunk and a 64-class lm_head with a bf16 gradient, (12, 8) tokens per step"))


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's ``fused_linear_cross_entropy_forward`` (mean over the tokens, no ignored ones): the gradients are made
    chunk by chunk in the forward and handed back by the backward. ``accum_dtype`` None: ``grad_weight`` is
    allocated like the weight, bfloat16, each chunk's sum rounded to it; else accumulated in full precision and
    cast to the weight's bfloat16 once."""

    @staticmethod
    def forward(ctx, _input, weight, target, accum_dtype):
        BT, H = _input.shape
        V = weight.shape[0]
        chunk_size = 2 ** math.ceil(math.log2(math.ceil(BT / math.ceil(V / H))))
        grad_input = torch.zeros_like(_input)
        grad_weight = torch.zeros_like(weight)
        loss = _input.new_zeros(())
        for start in range(0, BT, chunk_size):
            _input_chunk, target_chunk = _input[start:start + chunk_size], target[start:start + chunk_size]
            logits_chunk = _input_chunk @ weight.t()
            loss = loss + F.cross_entropy(logits_chunk, target_chunk, reduction="sum") / BT
            grad_logits_chunk = (logits_chunk.softmax(-1) - F.one_hot(target_chunk, V).to(logits_chunk.dtype)) / BT
            grad_input[start:start + chunk_size] = grad_logits_chunk @ weight
            grad_weight += grad_logits_chunk.t() @ _input_chunk
            if accum_dtype is None:
                grad_weight = bf16(grad_weight)  # the buffer is the weight's bfloat16
        ctx.save_for_backward(grad_input, bf16(grad_weight))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input * grad_output, grad_weight * grad_output, None, None


def train_step(model, optimizer, batch, accum_dtype=torch.float32):
    """The team's step as Liger's patched causal-LM forward runs it (``lce_forward``): the trunk's hidden states and
    the lm_head's weight go to the fused loss; the lm_head itself is never called."""
    inputs, targets = batch
    hidden = model.trunk(inputs)
    loss = FusedLinearCrossEntropy.apply(hidden.reshape(-1, HIDDEN), model.head.weight, targets.reshape(-1),
                                         accum_dtype)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, accum_dtype=None)


def buggy():
    return ec.check_step(TOKENS, train_step_as_reported)


def fixed():
    return ec.check_step(TOKENS, train_step)
