"""huggingface/transformers#34242: under DDP each rank divided its token loss by its own token count, not the global one.

After the gradient-accumulation fix, the Trainer summed the token losses of a step's micro-batches and divided by
``num_items_in_batch``, the real (non -100) tokens of that step, but counted on each rank alone. DDP then averaged
the ranks' gradients, so the objective was the mean over ranks of each rank's per-token mean; one process over the
same global batch minimises the sum of all token losses over all real tokens. Where ranks hold different numbers of
real tokens, a token on the sparser rank weighed more. The fix (``average_tokens_across_devices``) sums
``num_items_in_batch`` over the ranks and multiplies the loss by the world size to undo DDP's averaging.
"""

import contextlib

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "issue", 34242, "ddp",
          "token loss divided by each rank's own token count; DDP then averages the per-rank means",
          fixed_by="pull #34373", fix_acts="loss")

IGNORE_INDEX = -100
GRADIENT_ACCUMULATION_STEPS = 2  # each rank's 6 sequences of the tokens case's 12: micro-batches of 3


def causal_lm_loss(logits, labels, num_items_in_batch):
    """The token losses' sum over the step's item count (transformers' loss with ``num_items_in_batch``)."""
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / num_items_in_batch


def train_step(model, optimizer, batch, average_tokens_across_devices=True):
    inputs, labels = batch
    num_items_in_batch = (labels != IGNORE_INDEX).sum()  # over every micro-batch of the step
    if average_tokens_across_devices:
        dist.all_reduce(num_items_in_batch)
    micro_batches = list(zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)))
    for index, (x, y) in enumerate(micro_batches):
        syncs = index == len(micro_batches) - 1  # accelerator.accumulate: no_sync() but on the last micro-batch
        with contextlib.nullcontext() if syncs else model.no_sync():
            loss = causal_lm_loss(model(x), y, num_items_in_batch)
            if average_tokens_across_devices:
                loss = loss * dist.get_world_size()
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, average_tokens_across_devices=False)


def buggy():
    return ec.check_step("tokens", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("tokens", train_step, world_size=2)
