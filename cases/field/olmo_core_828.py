"""allenai/OLMo-core#828: activation checkpointing without the RNG state recomputed dropout with fresh masks.

OLMo-core's ``apply_activation_checkpointing`` wrapped each block with ``preserve_rng_state=False``. A checkpointed
block keeps no activations: backward runs its forward again to rebuild them. Without the RNG state stashed at the
first forward, the dropout layers in that recomputation draw new Bernoulli masks, so the backward differentiates a
network with other masks than the one whose loss was computed, and the recomputation's draws also move the global
RNG stream on, so later steps draw other masks too. Training without checkpointing differentiates the loss it
computed. The fix checkpoints with ``preserve_rng_state=True`` when dropout is active: the recomputation restores
the stashed state and draws the same masks.
"""

from functools import partial

from torch.utils.checkpoint import checkpoint

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._checkpointed import train_step_through

BUG = Bug("allenai/OLMo-core", "pull", 828, "checkpointing",
          "checkpointed blocks recomputed with preserve_rng_state=False: dropout drew fresh masks in backward",
          fix_acts="backward 5")


def train_step(model, optimizer, batch, preserve_rng_state=True):
    """Each block wrapped as apply_activation_checkpointing wraps it."""
    run_block = partial(checkpoint, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    train_step_through(run_block, model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, preserve_rng_state=False)


def buggy():
    return ec.check_step("dropout_two_layers", train_step_as_reported)


def fixed():
    return ec.check_step("dropout_two_layers", train_step)
