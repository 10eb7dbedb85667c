"""NVIDIA/TransformerEngine#1047: an FP8 weight cache reused across micro-batches was read with a newer scale.

With gradient accumulation a TE layer casts its weight to FP8 once per step: ``is_first_microbatch=True`` casts it and
keeps the cast, ``False`` reuses it. Delayed scaling updates every scale when ``fp8_autocast`` exits, after each
micro-batch, so the weight's scale has moved by the second micro-batch while the cached data were cast with the old one.
The report (open, no fix named) measures a ``te.pytorch.Linear(768, 768)`` against its unquantized output: TE 1.2.1 errs
by 0.068 on micro-batch 0 and 0.073 from micro-batch 1 on, TE 1.7 by 0.068 and then 1.71, and its training runs became
unstable with the upgrade. The row reads the jump as the cache's data taken with the meta's updated ``scale_inv``: on
the report's first iteration the weight is cast at scale 1 and the scale then becomes about 448 / 0.036, so the cached
weight reads back some 12,000 times too small and the output loses nearly all of ``W x``, whose largest entries are of
the size 1.7. The older code kept the weight's ``scale_inv`` with the cast it belongs to (its scale update took
``update_weight_scale_inv`` for the first micro-batch only, and a ``Float8Tensor`` keeps its own copy,
NVIDIA/TransformerEngine#706), which the run as fixed does. Here the tensor rows' TinyGPT computes its three linear
layers through FP8 weights under TE's delayed scaling (``_fp8``), the activations left in the case's float64 so that
nothing but the weight is quantized (an activation's delayed scale moves between micro-batches whatever the cache does);
the team's step accumulates 3 micro-batches, as Megatron drives TE (``set_is_first_microbatch`` before the step),
against one process taking the whole batch in one forward, which casts each weight once. As reported, micro-batches 1
and 2 of step 0 compute with weights read back 1,300 to 1,800 times too small (448 over each weight's amax); as fixed,
every micro-batch reads the one cast.
"""

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._fp8 import Fp8GPT, set_is_first_microbatch
from equivcheck_cases.field._tensor import token_case, token_loss

BUG = Bug("NVIDIA/TransformerEngine", "issue", 1047, "precision",
          "FP8 weight cache reused across micro-batches read with the updated scale_inv, not its own",
          fixed_by="open; the cache read with the scale_inv it was cast with (TE 1.2.1's behaviour)",
          fix_acts="forward up")

MICRO_BATCHES = 3


def fp8_gpt():
    return Fp8GPT(fp8_inputs=False, cache_scale_inv="own")


def fp8_gpt_as_reported():
    return Fp8GPT(fp8_inputs=False, cache_scale_inv="meta")


GPT = ec.register_case(token_case(
    "field_te_fp8_weight_cache", fp8_gpt,
    "TinyGPT with FP8 (E4M3) weights under delayed scaling, its weight cache read with its own scale_inv"))
GPT_AS_REPORTED = ec.register_case(token_case(
    "field_te_fp8_weight_cache_as_reported", fp8_gpt_as_reported,
    "TinyGPT with FP8 (E4M3) weights under delayed scaling, its weight cache read with the meta's scale_inv"))


def train_step(model, optimizer, batch):
    """The team's step: the FP8 layers told a step begins, 3 micro-batches each under its own ``fp8_autocast`` (the
    model's forward), each micro-batch's token-loss sum over the batch's tokens, one optimizer step."""
    inputs, targets = batch
    set_is_first_microbatch(model)
    total = torch.zeros((), dtype=inputs.dtype)
    for micro_inputs, micro_targets in zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)):
        loss = token_loss(model(micro_inputs), micro_targets).sum() / targets.numel()
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total


def buggy():
    return ec.check_step(GPT_AS_REPORTED, train_step)


def fixed():
    return ec.check_step(GPT, train_step)
