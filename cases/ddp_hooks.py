"""DDP with a compressing comm hook (float16, bfloat16, PowerSGD) and FSDP2 reducing in bfloat16
(``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``): each judged at its own error bound, and the per-rank
mean-loss bug still caught beside them.

Seven samples per step over two ranks (shards of 4 and 3): a rank's *mean* loss weights them 1/2 each
instead of 4/7 and 3/7, an error far above what float16 compression does to the gradients.
"""

import dataclasses

import torch

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from .mlp import mlp

FP16, BF16 = "ddp_hook:world_size=2,hook=fp16", "ddp_hook:world_size=2,hook=bf16"
POWERSGD = "ddp_hook:world_size=2,hook=powersgd"
POWERSGD_FROM_STEP_2 = "ddp_hook:world_size=2,hook=powersgd,start_iter=2"
FSDP_BF16_REDUCE = "fsdp:world_size=2,reduce_dtype=bf16"


def seven_per_step():
    return torch.randn(21, 6), torch.randint(0, 3, (21,))


ddp_compressed_uneven_shards = ec.register_case(dataclasses.replace(
    mlp,
    name="ddp_compressed_uneven_shards",
    data=seven_per_step,
    batch_size=7,
    regimes=("full_batch", "ddp:world_size=2", FP16, "ddp_hook_mean_loss:world_size=2,hook=fp16", BF16, POWERSGD,
             POWERSGD_FROM_STEP_2, FSDP_BF16_REDUCE),
    expect_mismatch={
        "ddp_hook_mean_loss": "7 samples over 2 ranks: shards of 4 and 3 averaged equally, under float16 compression",
        "fsdp_mean_loss": "7 samples over 2 ranks: shards of 4 and 3 averaged equally, reduced in bfloat16",
        POWERSGD_FROM_STEP_2: "PowerSGD replaces step 2's gradient matrices by rank-1 approximations: lossy "
                              "beyond any element-wise bound",
    },
    description="lossy reductions at their own error bound: DDP's fp16, bf16 and PowerSGD hooks, FSDP2's bf16 "
                "reduce-scatter; per-rank mean loss under fp16 and bf16",
))

# The catalogue's entry that uses this case.
add_entry(Entry("DDP per-rank mean loss under fp16 gradient compression", "ddp_compressed_uneven_shards",
                "ddp_hook_mean_loss:world_size=2,hook=fp16"))
