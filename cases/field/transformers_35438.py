"""huggingface/transformers#35438: a model whose loss ignored ``num_items_in_batch`` was never divided by K.

After the token-count fix, ``Trainer.training_step`` skipped its division by the accumulation steps whenever it
handed the model a ``num_items_in_batch``, trusting the model to divide its summed loss by that global count. A
model that does not accept loss kwargs ignores the count and returns its micro-batch mean, so nothing divided by K:
the K accumulated means gave K times the gradient of the global batch's mean, a learning rate silently multiplied
by the accumulation steps. Full-batch training takes one mean over the global batch. The fix hands
``num_items_in_batch=None`` to the training step of a model that does not accept loss kwargs, so the Trainer divides
by K again (exact for equal micro-batches).
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "pull", 35438, "accumulation",
          "model's loss ignores num_items_in_batch, so the Trainer divided by neither it nor K", fix_acts="loss")

GRADIENT_ACCUMULATION_STEPS = 4  # mlp's 12 samples a step: 4 equal micro-batches of 3
MODEL_ACCEPTS_LOSS_KWARGS = False  # the model's forward takes no num_items_in_batch


def compute_loss(model, inputs, labels, num_items_in_batch=None):
    """The model's own loss: a mean over its micro-batch (it has no use for num_items_in_batch)."""
    return F.cross_entropy(model(inputs), labels)


def training_step(model, inputs, labels, num_items_in_batch=None):
    loss = compute_loss(model, inputs, labels, num_items_in_batch)
    if num_items_in_batch is None:  # the model did not normalise by the window's items: the Trainer divides by K
        loss = loss / GRADIENT_ACCUMULATION_STEPS
    loss.backward()
    return loss.detach()


def train_step(model, optimizer, batch, accepts_loss_kwargs=MODEL_ACCEPTS_LOSS_KWARGS):
    inputs, labels = batch
    num_items_in_batch = len(labels)
    for x, y in zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)):
        training_step(model, x, y, num_items_in_batch if accepts_loss_kwargs else None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, accepts_loss_kwargs=True)  # the count passed whatever the model accepts


def buggy():
    return ec.check_step("mlp", train_step_as_reported)


def fixed():
    return ec.check_step("mlp", train_step)
