"""pytorch/ao#4912: AdamW8bit chose 8-bit or full-precision state by the local shard's size, so the mesh changed it.

torchao's low-bit optimizers allocate a moment in ``_new_buffer``, which quantises it to 8 bits only for a tensor of
4,096 elements or more that holds a whole number of 256-element blocks, and measures that on ``p.to_local()``. Under
FSDP2 the local tensor is the rank's shard, so one logical parameter gets 8-bit moments when it is replicated and
full-precision moments once it is sharded: the report's (6, 1024) parameter holds 6,144 elements on a 2 x 1
(replicate x shard) mesh and 3,072 per rank on a 1 x 2 mesh, and its updates change with the mesh alone. The fix
(pull #4913, a draft) decides on the global parameter's size, allocates the state on the local shard, and accepts a
newly eligible shard only where it keeps whole blocks of the parameter (replicated or sharded on dimension 0). Here
the report's parameter is the first layer of a small classifier (1,024 features, 6 hidden units, 3 classes) trained
by the blockwise 8-bit AdamW of ``equivcheck_cases.eight_bit`` at torchao's defaults, fully sharded over 2 ranks as FSDP2 shards it,
against one process, where the parameter is whole and its moments 8-bit. As reported, each rank's 3,072-element
shard keeps float64 moments, and from the second step its update parts from the one process's by about 1% of the
step; as fixed, the shard's moments are quantised in the parameter's own blocks and the updates agree.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.eight_bit import AdamW8bit
from equivcheck_cases.field._references import fully_sharded, mean_loss_step

BUG = Bug("pytorch/ao", "issue", 4912, "precision",
          "AdamW8bit picked 8-bit vs fp32 state from the local shard's numel: sharding changed the updates",
          fixed_by="pull #4913", fix_acts="optimizer 0")

FEATURES, HIDDEN, CLASSES = 1024, 6, 3  # the first layer's weight is the report's (6, 1024) parameter


def model():
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def data():
    return torch.randn(36, FEATURES), torch.randint(0, CLASSES, (36,))


def adamw8bit(parameters):
    """As fixed: the state's precision decided on the global parameter's size."""
    return AdamW8bit(parameters, size_of="global")


def adamw8bit_as_reported(parameters):
    """As reported: decided on the local shard's size."""
    return AdamW8bit(parameters, size_of="local")


def _case(name, optimizer, description):
    return ec.register_case(ec.Case(name=name, model=model, data=data,
                                    loss=lambda logits, y: F.cross_entropy(logits, y, reduction="none"),
                                    batch_size=12, steps=3, optimizer=optimizer, description=description))


CLASSIFIER = _case("field_ao_adamw8bit", adamw8bit,
                   "1024-6-3 tanh classifier under a blockwise 8-bit AdamW deciding on the global size")
CLASSIFIER_AS_REPORTED = _case("field_ao_adamw8bit_as_reported", adamw8bit_as_reported,
                               "1024-6-3 tanh classifier under a blockwise 8-bit AdamW deciding on the local size")


def buggy():
    return ec.check_step(CLASSIFIER_AS_REPORTED, mean_loss_step, world_size=2, wrap=fully_sharded)


def fixed():
    return ec.check_step(CLASSIFIER, mean_loss_step, world_size=2, wrap=fully_sharded)
