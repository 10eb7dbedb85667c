"""Recipes for the training frameworks teams use instead of a hand-written loop.

Each turns a framework's own configuration into a ``check_loop`` loop: the framework trains the case's
model with the case's optimizer, on the case's global batches in order, so equivcheck compares what
the framework computes with full-batch training. Every framework is imported when a loop runs, never
here: equivcheck itself needs none of them (``pip install equivcheck[frameworks]`` brings them).

- :func:`lightning_loop`: a Lightning ``Trainer`` configuration around a team's ``LightningModule``.
- :func:`trainer_loop`: a Hugging Face ``Trainer`` configuration (``TrainingArguments``).
- Accelerate has no helper: a team's Accelerate loop is already a ``check_loop`` loop (see the README).
"""

from .hf_trainer import trainer_loop
from .lightning import lightning_loop

__all__ = ["lightning_loop", "trainer_loop"]
