"""NVIDIA/Megatron-LM#442: FP8 amax histories were reduced over the data-parallel group only, so TP ranks scaled apart.

Megatron's transformer handed Transformer Engine ``fp8_group = mpu.get_data_parallel_group()``. TE all-reduces each
FP8 tensor's amax over that group when ``fp8_autocast`` exits and derives the next iterations' scales from it, so
the ranks of one tensor-parallel group never agreed on a scale: each cast its own shard of a weight (and its own
slice of a row-parallel layer's input) with the scale of its shard's amax, where one process casts the whole matrix
with the scale of the whole matrix's amax. The pull reports 40B GPT runs at tensor-parallel size 8 that all diverged
after about 1,000 iterations, and runs that stayed stable once the group was NeMo's; Megatron fixed it internally
(``fp8_group = mpu.get_amax_reduction_group()``, the data- and tensor-parallel ranks together), and TE's maintainer
says the same in NVIDIA/TransformerEngine#656: activations and their gradients need consistent scales when they are
distributed. Here the tensor rows' TinyGPT computes its three linear layers in FP8 under TE's delayed scaling
(``_fp8``: E4M3 casts of each input and weight, amax history, scale 448 / amax), Megatron-style on 2 tensor-parallel
ranks (``up`` column-parallel, ``down`` row-parallel, the output layer column-parallel; data-parallel size 1, so each
rank's data-parallel group holds the rank alone), against one process running the same recipe. Step 0 casts at
scale 1 everywhere and matches; as reported, step 1's ``up`` casts each TP rank's rows with its own shard's scale and
parts; as fixed, the amaxes meet over both ranks and every cast is the one process's.
"""

import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._fp8 import Fp8GPT
from equivcheck_cases.field._tensor import megatron_parallelize, token_case, token_step

BUG = Bug("NVIDIA/Megatron-LM", "pull", 442, "precision",
          "FP8 amax reduced over the DP group only: TP ranks cast their weight shards with different scales",
          fixed_by="fixed internally: fp8_group = mpu.get_amax_reduction_group() (DP x TP)",
          fix_acts="forward up")

MESH = {"tp": 2}

GPT = ec.register_case(token_case(
    "field_megatron_fp8_gpt", Fp8GPT, "TinyGPT whose three linear layers compute in FP8 (E4M3) under delayed scaling"))


def data_parallel_group():
    """Megatron's data-parallel group of this rank: with data-parallel size 1, the rank alone (every rank takes
    part in making each group, as ``new_group`` asks)."""
    groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def fp8_tensor_parallel(model, mesh, fp8_group):
    model = megatron_parallelize(model, mesh, sequence_parallel=False)
    model.fp8_group = fp8_group
    return model


def tensor_parallel(model, mesh):
    """As fixed: ``mpu.get_amax_reduction_group()``, the data- and tensor-parallel ranks together (with no pipeline
    or context parallelism, every rank)."""
    return fp8_tensor_parallel(model, mesh, dist.group.WORLD)


def tensor_parallel_as_reported(model, mesh):
    """As reported: ``fp8_group = mpu.get_data_parallel_group()``."""
    return fp8_tensor_parallel(model, mesh, data_parallel_group())


def buggy():
    return ec.check_step(GPT, token_step, mesh=MESH, parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step(GPT, token_step, mesh=MESH, parallelize=tensor_parallel)
