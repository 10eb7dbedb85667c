"""A Hugging Face ``Trainer`` configuration (its ``TrainingArguments``) as a ``check_loop`` loop.

The case's model is the Trainer's model: a ``PreTrainedModel`` whose forward takes ``input_ids`` and
``labels``; the case's inputs are the input ids and its targets the labels (-100 where padding). With
``gradient_accumulation_steps`` the Trainer counts the label tokens of all the step's micro-batches
(``num_items_in_batch``) and a model that accepts loss kwargs divides its token-loss sum by that count:
the global mean. A model that does not (``accepts_loss_kwargs = False``) returns each micro-batch's
mean, which the Trainer divides by K: the 2024 gradient-accumulation bug, wrong with uneven lengths.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer

from ..errors import InvalidArgument
from .naming import call_arguments

# What the reference shares with the loop, so that only the configuration under test differs: the
# samples in order, the case's optimizer at its own learning rate, no clipping unless asked for.
# The rest is plumbing: no logs, reports, checkpoints or worker processes.
SHARED = dict(train_sampling_strategy="sequential", lr_scheduler_type="constant", max_grad_norm=0.0,
              report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
              dataloader_num_workers=0, disable_tqdm=True)


def trainer_loop(**training_arguments) -> Callable:
    """A loop that trains the case's model with ``Trainer(args=TrainingArguments(**training_arguments))``
    and the case's optimizer, ``max_steps`` = the case's steps, each global batch cut into
    ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size`` samples.
    Losses are left out of the comparison; gradients and weights are compared.
    """
    k = training_arguments.get("gradient_accumulation_steps", 1)

    def loop(model: nn.Module, optimizer: Optimizer, batches: list) -> None:
        from transformers import Trainer, TrainingArguments

        size = len(batches[0][0])
        if size % k:
            raise InvalidArgument.value("gradient_accumulation_steps", k,
                                        f"a divisor of the case's batch_size {size}: the micro-batches tile each global batch")
        samples = [{"input_ids": x, "labels": y} for inputs, targets in batches for x, y in zip(inputs, targets)]
        with tempfile.TemporaryDirectory() as output_dir:
            args = TrainingArguments(**{**SHARED, "output_dir": output_dir, "per_device_train_batch_size": size // k,
                                        "max_steps": len(batches), **training_arguments})
            Trainer(model=model, args=args, train_dataset=samples, optimizers=(optimizer, None)).train()

    loop.__qualname__ = f"trainer_loop({call_arguments(training_arguments)})"
    return loop
