"""modelscope/mcore-bridge#173: under TP + SP the replicated LoRA factor's gradients were never summed over TP.

With ``tensor_model_parallel_size > 1`` and ``sequence_parallel=True``, ``LoraParallelLinear.update_layer`` builds
one factor of each adapter replicated on every TP rank: ``lora_A`` of a column-parallel target (``linear_qkv``,
``linear_fc1``), which consumes the sequence-sharded input, and ``lora_B`` of a row-parallel target (``linear_proj``,
``linear_fc2``), which runs after ``lora_A``'s reduce-scatter. Each sees only its own rank's sequence chunk, so its
gradient is that chunk's part; Megatron sums such gradients in ``finalize_model_grads`` only for parameters flagged
``param.sequence_parallel = True``, as it flags the layernorms, and ``LoraParallelLinear`` never set the flag. Each
TP rank trained its own copy of the factor, and ``export_weights`` saved rank 0's (the pull found the exported
last-layer ``linear_proj.lora_B`` all zeros). The pull sums the replicated factor's gradients over the TP group.
Scaled down: the tiny GPT frozen with rank-2 adapters on its column-parallel ``up`` and row-parallel ``down``
(``_lora_tp.py``), TP = 2 with SP, Megatron's finalizer summing every flagged parameter's gradient: as reported the
factors are unflagged, as fixed flagged.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._lora_tp import lora_parallelize
from equivcheck_cases.field._tensor import token_step
from equivcheck_cases.field.megatron_lm_1446 import finalize_model_grads

BUG = Bug("modelscope/mcore-bridge", "pull", 173, "adapters",
          "TP + SP: the replicated LoRA factor lacked the sequence_parallel flag: its grads were never summed",
          fix_acts="communication up_adapter")


def lora_parallelize_as_reported(model, mesh):
    """The factors built as ``LoraParallelLinear`` built them: no ``sequence_parallel`` flag."""
    return lora_parallelize(model, mesh, flag_replicated=False)


def train_step(model, optimizer, batch):
    return token_step(model, optimizer, batch, finalize_model_grads)


def buggy():
    return ec.check_step("field_lora_gpt", train_step, mesh={"tp": 2},
                         parallelize=lora_parallelize_as_reported)


def fixed():
    return ec.check_step("field_lora_gpt", train_step, mesh={"tp": 2}, parallelize=lora_parallelize)
