"""NVIDIA/Megatron-LM#1446: under TP + SP the final layernorm's gradients were never all-reduced over the TP group.

With sequence parallelism each TP rank runs the norms on its own chunk of the sequence, so a norm's gradient on one
rank is the sum over that chunk only; Megatron's gradient finalizer (``_allreduce_layernorm_grads`` in
``finalize_model_grads``) adds the chunks up by all-reducing, over the TP group, every parameter marked
``sequence_parallel``. The report found ``final_layernorm``'s ``main_grad`` different on every TP rank before
``optimizer.step()``, so each rank stepped its copy with its own chunk's gradient where one process steps with the
whole sequence's. The thread names neither a cause nor a fix; the cause taken here is this row's inference, not the
report's: NVIDIA/TransformerEngine pull #1528, opened days before, fits it: TE's standalone LayerNorm/RMSNorm
modules (what Megatron's TE spec builds ``final_layernorm`` with; the other norms are fused into TE's
LayerNorm-Linear layers, which set the flag) had stopped setting ``sequence_parallel`` on their parameters (TE pull
#1033), so the finalizer skipped exactly that norm; #1528 sets the flag again. Here the team's Megatron-style model
(``_tensor.TinyGPT``: a block, the final norm, a column-parallel output layer) runs with SP on 2 ranks, its final
norm built without the flag as reported and with it as fixed; its sharded weights are DTensors read back through
``full_tensor()``, its norms plain tensors every rank holds.
"""

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import megatron_parallelize, token_step

BUG = Bug("NVIDIA/Megatron-LM", "issue", 1446, "tensor",
          "TP + SP: final_layernorm params lacked the sequence_parallel flag, so its grads were never summed",
          fixed_by="NVIDIA/TransformerEngine pull #1528 (inferred: the thread names no fix)",
          fix_acts="communication final_norm")


def sequence_parallel(model, mesh):
    """The team's Megatron config: TP over mesh['tp'] with sequence parallelism, every norm flagged."""
    return megatron_parallelize(model, mesh, sequence_parallel=True)


def sequence_parallel_as_reported(model, mesh):
    """The final norm's parameters built without the flag, as the TE norm module left them."""
    model = megatron_parallelize(model, mesh, sequence_parallel=True)
    for parameter in model.final_norm.parameters():
        del parameter.sequence_parallel
    return model


def finalize_model_grads(model):
    """Megatron's ``_allreduce_layernorm_grads``: under SP, sum the flagged parameters' gradients over TP."""
    grads = [p.grad for p in model.parameters() if p.requires_grad and getattr(p, "sequence_parallel", False)]
    if model.sequence_parallel and grads:
        coalesced = _flatten_dense_tensors(grads)
        dist.all_reduce(coalesced, group=model.tp_group)
        for grad, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
            grad.copy_(synced)


def train_step(model, optimizer, batch):
    return token_step(model, optimizer, batch, finalize_model_grads)


def buggy():
    return ec.check_step("field_tiny_gpt", train_step, mesh={"tp": 2}, parallelize=sequence_parallel_as_reported)


def fixed():
    return ec.check_step("field_tiny_gpt", train_step, mesh={"tp": 2}, parallelize=sequence_parallel)
