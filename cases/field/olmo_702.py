"""allenai/OLMo#702: the checkpoint helper turned RNG preservation off exactly when the model had dropout.

OLMo builds its activation-checkpointing function from the model config: ``activation_checkpoint_function(cfg)``
returns ``checkpoint`` with ``preserve_rng_state`` bound, and every block runs its forward through it. The flag was
computed as "all dropout probabilities are zero", the inverse of what it should be, so a model with dropout was
checkpointed without the RNG state: backward re-ran each block's forward with fresh dropout masks, differentiating
another sub-network than the one whose loss was computed, and the extra draws shifted every later step's masks too.
A training step without checkpointing differentiates the loss it computed. The fix negates the condition, so the
RNG state is stashed and restored whenever any dropout is non-zero (the sole change below is that ``not``).
"""

import dataclasses
from functools import partial

from torch.utils.checkpoint import checkpoint

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._checkpointed import train_step_through

BUG = Bug("allenai/OLMo", "pull", 702, "checkpointing",
          "checkpoint function built with preserve_rng_state = (no dropout): RNG dropped when dropout was on",
          fix_acts="backward 5")


@dataclasses.dataclass
class ModelConfig:
    """The fields OLMo's helper reads; dropout_two_layers has Dropout(0.5) after each hidden layer."""

    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    residual_dropout: float = 0.5


def activation_checkpoint_function(cfg: ModelConfig):
    preserve_rng_state = not (
        (cfg.attention_dropout == 0.0) and (cfg.embedding_dropout == 0.0) and (cfg.residual_dropout == 0.0)
    )
    return partial(checkpoint, preserve_rng_state=preserve_rng_state, use_reentrant=False)


def activation_checkpoint_function_as_reported(cfg: ModelConfig):
    preserve_rng_state = (
        (cfg.attention_dropout == 0.0) and (cfg.embedding_dropout == 0.0) and (cfg.residual_dropout == 0.0)
    )
    return partial(checkpoint, preserve_rng_state=preserve_rng_state, use_reentrant=False)


def train_step(model, optimizer, batch, make_checkpoint_fn=activation_checkpoint_function):
    """Every block's forward through the checkpoint function the config makes, as OLMo's blocks run."""
    train_step_through(make_checkpoint_fn(ModelConfig()), model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, make_checkpoint_fn=activation_checkpoint_function_as_reported)


def buggy():
    return ec.check_step("dropout_two_layers", train_step_as_reported)


def fixed():
    return ec.check_step("dropout_two_layers", train_step)
