"""NVIDIA-NeMo/Megatron-Bridge#5900: adapters on duplicated linears were TP-sharded, joining features of other tokens.

MLA's q/kv down-projections are duplicated ``TELinear`` bases: the same whole weight on every TP rank, each rank
running it under sequence parallelism on its own chunk of the tokens, with no collective. Bridge built their LoRA,
DoRA and MultiLoRA adapters with TP-sharded factors all the same, as for a column-parallel base, and gathered the
adapter's output along the features: each rank's slice of the features came from its own tokens, so the gathered
delta joined values computed from different tokens. The shapes fit, and adapter outputs and gradients were wrong. The
pull builds such adapters' factors whole on every rank (a replicated-factor topology), keeps the sequence-parallel
input local, skips the feature gather, and lets Megatron-Core sum the replicated factors' gradients over TP. Scaled
down: the tiny GPT frozen with a duplicated linear after its block (``_lora_tp.DuplicatedLoRAGPT``), every linear
adapted, TP = 2 with SP; as reported the duplicated linear's ``lora_b`` is sharded over its output features and the
delta gathered, as fixed both factors are whole and flagged for the finalizer's sum.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._lora_tp import lora_parallelize
from equivcheck_cases.field._tensor import shard_
from equivcheck_cases.field.mcore_bridge_173 import train_step

BUG = Bug("NVIDIA-NeMo/Megatron-Bridge", "pull", 5900, "adapters",
          "TP + SP: a duplicated linear's adapter built TP-sharded: its gathered delta mixed other tokens",
          fix_acts="forward mix_adapter")


def lora_parallelize_as_reported(model, mesh):
    """The duplicated linear's adapter built as a column-parallel one: ``lora_b`` sharded over its output features."""
    model = lora_parallelize(model, mesh)
    shard_(model.mix_adapter, "lora_b", mesh["tp"], 0)
    return model


def buggy():
    return ec.check_step("field_duplicated_lora_gpt", train_step, mesh={"tp": 2},
                         parallelize=lora_parallelize_as_reported)


def fixed():
    return ec.check_step("field_duplicated_lora_gpt", train_step, mesh={"tp": 2}, parallelize=lora_parallelize)
