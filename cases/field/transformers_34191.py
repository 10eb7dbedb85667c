"""huggingface/transformers#34191: under gradient accumulation the Trainer averaged per-micro-batch token means.

For causal-LM training each micro-batch's cross-entropy was a mean over that micro-batch's real (not ignored)
tokens, and the Trainer divided each of those K means by K before its backward. Full-batch training takes one mean
over every real token of the global batch: the summed token loss divided by the global count. When micro-batches
hold different numbers of real tokens (padding, short sequences) the mean of means weights a token of a sparse
micro-batch more than a token of a full one, so the update differed from the run without accumulation. The fix
counts the real tokens of the whole accumulation window up front (``num_items_in_batch``), and each micro-batch
backpropagates its summed token loss divided by that count, with no further division by K.
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "pull", 34191, "accumulation",
          "mean of per-micro-batch token means / K instead of the token sum / the window's real tokens",
          fix_acts="loss")

GRADIENT_ACCUMULATION_STEPS = 4  # tokens' 12 sequences a step: 4 micro-batches of 3, with unequal real tokens
IGNORE_INDEX = -100


def causal_lm_loss(logits, labels, num_items_in_batch=None):
    """The model's loss: a mean over its real tokens, or their sum over the count it is handed."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def train_step(model, optimizer, batch, count_items=True):
    inputs, labels = batch
    num_items_in_batch = int((labels != IGNORE_INDEX).sum()) if count_items else None
    for x, y in zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)):
        loss = causal_lm_loss(model(x), y, num_items_in_batch)
        if num_items_in_batch is None:
            loss = loss / GRADIENT_ACCUMULATION_STEPS
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, count_items=False)


def buggy():
    return ec.check_step("tokens", train_step_as_reported)


def fixed():
    return ec.check_step("tokens", train_step)
