"""A Lightning ``Trainer`` configuration as a ``check_loop`` loop.

Lightning's automatic optimisation divides each micro-batch's loss by ``accumulate_grad_batches``,
clips inside the closure it hands to ``optimizer.step`` and runs the last micro-batch's forward and
backward there too: equivcheck records the gradients after that closure, as the optimizer uses them.
Dividing by K is the global mean only when the micro-batches have equal item counts; the loop cuts
each global batch into ``accumulate_grad_batches`` micro-batches, so choose a K that divides it evenly
(or return a loss normalised by the global item count times K from ``training_step``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from ..errors import InvalidArgument, expect_callable
from .naming import call_arguments

# Plumbing only: what the loop must not do (log, save, print, validate) and where it runs.
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0, accelerator="cpu", devices=1)


def lightning_loop(module: Callable[[nn.Module], object], **trainer_options) -> Callable:
    """A loop that fits ``module(model)`` (a team's ``LightningModule`` around the case's model) with
    ``Trainer(**trainer_options)`` for one epoch over the case's global batches, each cut into
    ``accumulate_grad_batches`` micro-batches, and the case's optimizer in place of the module's own.

    ``trainer_options`` are the configuration under test (``accumulate_grad_batches``,
    ``gradient_clip_val``, ``precision``, ...); logging, checkpoints and progress bars are off unless
    they say otherwise. Losses are left out of the comparison; gradients and weights are compared.
    """
    expect_callable("module", module)

    def loop(model: nn.Module, optimizer: Optimizer, batches: list) -> None:
        lightning_module = module(model)
        trainer_class = _trainer_class(lightning_module)
        lightning_module.configure_optimizers = lambda: optimizer
        trainer = trainer_class(**{**QUIET, "max_epochs": 1, **trainer_options})
        k = trainer.accumulate_grad_batches
        micro = [pair for inputs, targets in batches for pair in zip(inputs.tensor_split(k), targets.tensor_split(k))]
        trainer.fit(lightning_module, DataLoader(micro, batch_size=None))

    loop.__qualname__ = f"lightning_loop({call_arguments(trainer_options)})"
    return loop


def _trainer_class(lightning_module: object) -> type:
    """The ``Trainer`` of the package the module comes from: ``lightning.pytorch`` or ``pytorch_lightning``."""
    for cls in type(lightning_module).__mro__:
        if cls.__name__ == "LightningModule":
            return importlib.import_module(cls.__module__.partition(".core")[0]).Trainer
    raise InvalidArgument.type("module", lightning_module, "a factory returning a LightningModule")
