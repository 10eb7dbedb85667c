"""Teams' FSDP2 wraps that set a precision policy on their modules (imported by name on the ranks)."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

BF16_PARAMETERS = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_in_bf16(model):
    """The most common FSDP2 recipe: every block and the root, computing in bf16, reducing in float32."""
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mp_policy=BF16_PARAMETERS)
    return fully_shard(model, mp_policy=BF16_PARAMETERS)


def shard(model):
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block)
    return fully_shard(model)
