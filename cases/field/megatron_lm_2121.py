"""NVIDIA/Megatron-LM#2121: padding tokens were counted in the MoE router's load-balancing statistics.

Megatron's router computed its load-balancing loss over every position it routed, padding included: the padding
positions' routed slots entered each sequence's fraction of tokens per expert, their router probabilities the mean
probability, and the counts they were divided by held the padding too. What the loss asks of the router then depends
on how much padding the batch carries, which is a property of the collator, not of the data: a collator that pads
each micro-batch to its own longest sequence (as SFT collators do) pads less under gradient accumulation than the
whole batch padded once, so the same sequences get another balance loss, and another router gradient, when the batch
is cut. The fix passes a ``padding_mask`` from the model down to the router, which leaves padding out of the counts,
the probabilities and the z-loss. Here the balance loss is the sequence-wise one (``seq_aux_loss``, one value per
sequence), so that with the padding left out, accumulation is exactly the whole batch; the reference is the team's
own step on the whole batch, padded once to its longest sequence.
"""

import functools

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import BALANCE_WEIGHT, IGNORE, PAD, sequence_balance

BUG = Bug("NVIDIA/Megatron-LM", "pull", 2121, "moe",
          "padding tokens counted in the router's load-balancing loss: its value depends on the padding",
          fix_acts="loss")

MICRO_BATCHES = 6  # the 12 sequences of a global batch in micro-batches of 2, each padded to its own longest


def collate(tokens, labels):
    """Pad to the longest sequence given (the data is padded to 7; cut the columns no sequence here needs)."""
    longest = int((tokens != PAD).sum(1).max())
    return tokens[:, :longest], labels[:, :longest]


def train_step(model, optimizer, batch, micro_batches=MICRO_BATCHES, padding_mask=True):
    tokens, labels = batch
    num_tokens, num_sequences = (labels != IGNORE).sum(), len(tokens)
    for x, y in zip(tokens.chunk(micro_batches), labels.chunk(micro_batches)):
        x, y = collate(x, y)
        logits, scores, slots = model(x)
        routed = x != PAD if padding_mask else torch.ones_like(x, dtype=torch.bool)
        aux = sequence_balance(scores, slots, routed)
        lm = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        (lm / num_tokens + BALANCE_WEIGHT * aux.sum() / num_sequences).backward()
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, padding_mask=False)
whole_batch = functools.partial(train_step, micro_batches=1)
whole_batch_as_reported = functools.partial(train_step, micro_batches=1, padding_mask=False)


def buggy():
    return ec.check_step("field_moe", train_step_as_reported, reference=whole_batch_as_reported)


def fixed():
    return ec.check_step("field_moe", train_step, reference=whole_batch)
