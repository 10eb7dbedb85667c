"""NovaSky-AI/SkyRL#1886: latent, a fused LM head's non-contiguous gradient into Megatron's all-reduce, which drops it.

SkyRL's fused LM-head path skips Megatron's output layer: an ``output_processor`` returns the decoder's hidden
states and the log-probabilities are computed by a fused kernel over this rank's slice of the vocabulary, so the
gradient each TP rank sends back into the hidden states covers its slice only and must be summed over the TP group.
Pull #1886 put the hidden states through ``copy_to_tensor_model_parallel_region`` (forward: identity; backward:
all-reduce) and then ``transpose(0, 1).contiguous()`` into the [batch, sequence] layout. Its review found the flaw
for TP on with sequence parallelism off: the gradient reaching the copy's backward is the transpose of a contiguous
tensor, a non-contiguous view, and the pinned Megatron's ``_reduce`` all-reduces ``input_.contiguous()`` (a copy) and
returns ``input_``: the sum is computed and dropped, so each rank would train the decoder on its own vocabulary
slice's gradient, where one process uses the whole vocabulary's. The flaw is latent: SkyRL's Megatron worker turns
sequence parallelism on whenever TP > 1, so that path did not run, and Megatron's report of the ``_reduce`` flaw
(NVIDIA/Megatron-LM#5337) says no current call path of Megatron's triggers it; the row checks the path as written,
had it run. Megatron fixed ``_reduce`` to return the reduced tensor (pull #5338): the run as fixed pairs SkyRL's code
as merged with that ``_reduce``, a Megatron later than the one SkyRL pinned. The review's own proposal, transposing
before the copy, is equivalent too (measured). Here the team's Megatron-style model (``_tensor.TinyGPT``, TP on 2
ranks, SP off) runs the fused head; its shards are DTensors read back through ``full_tensor()``, its norms plain
tensors every rank holds.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import (
    CopyToTensorParallelRegion, GatherFromTensorParallelRegion, decoder, local, megatron_parallelize, token_mean,
)

BUG = Bug("NovaSky-AI/SkyRL", "pull", 1886, "tensor",
          "latent (SP off): fused LM head's non-contiguous grad into Megatron's _reduce: reduced copy dropped",
          fixed_by="NVIDIA/Megatron-LM pull #5338 (a Megatron later than SkyRL pinned)",
          fix_acts="communication final_norm")


class CopyToTensorParallelRegionFixed(torch.autograd.Function):
    """The same mapping over Megatron's ``_reduce`` as pull #5338 left it: the reduced (contiguous) tensor returned."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.contiguous()
        dist.all_reduce(grad_output, group=ctx.group)
        return grad_output, None


def tensor_parallel(model, mesh):
    return megatron_parallelize(model, mesh, sequence_parallel=False)


def fused_lm_head_step(copy_to_tensor_model_parallel_region):
    def train_step(model, optimizer, batch):
        inputs, targets = batch
        hidden_states = model.final_norm(decoder(model, inputs))  # the decoder's output, post-processing off
        # fused_lm_head_output_processor (allreduce_dgrad): into the TP region, then [s, b, h] -> [b, s, h]
        hidden_states = copy_to_tensor_model_parallel_region.apply(hidden_states, model.tp_group)
        hidden_states = hidden_states.transpose(0, 1).contiguous()
        # the fused log-prob over this rank's vocabulary slice, made whole for the loss
        logits = GatherFromTensorParallelRegion.apply(F.linear(hidden_states, local(model.head.weight)),
                                                      model.tp_group)
        loss = token_mean(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


train_step = fused_lm_head_step(CopyToTensorParallelRegionFixed)
train_step_as_reported = fused_lm_head_step(CopyToTensorParallelRegion)


def buggy():
    return ec.check_step("field_tiny_gpt", train_step_as_reported, mesh={"tp": 2}, parallelize=tensor_parallel)


def fixed():
    return ec.check_step("field_tiny_gpt", train_step, mesh={"tp": 2}, parallelize=tensor_parallel)
