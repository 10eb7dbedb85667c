"""Variable-length padded token sequences: the loss counts real tokens only.

Its negative control is the trainer bug of 2024: micro-batch *mean* / K. With equal chunks of
samples but unequal numbers of real tokens per chunk, that weights tokens unequally.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

VOCAB, DIM, MAX_LEN, PAD, IGNORE = 20, 8, 7, 0, -100


def model():
    return nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB))


def data():
    samples = 24
    lengths = torch.randint(1, MAX_LEN + 1, (samples,))
    real = torch.arange(MAX_LEN) < lengths[:, None]
    tokens = torch.where(real, torch.randint(1, VOCAB, (samples, MAX_LEN)), PAD)
    targets = torch.where(real, torch.randint(1, VOCAB, (samples, MAX_LEN)), IGNORE)
    return tokens, targets


def token_losses(logits, targets):
    flat = targets.reshape(-1)
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, reduction="none", ignore_index=IGNORE)
    return losses[flat != IGNORE]


def real_tokens(targets):
    return int((targets != IGNORE).sum())


tokens = ec.register_case(ec.Case(
    name="tokens",
    model=model,
    data=data,
    loss=token_losses,
    items=real_tokens,
    batch_size=12,
    steps=2,
    split=lambda m: (m[:3], m[3]),
    description="padded sequences of 1 to 7 tokens; the mean is over real tokens of the global batch",
))

naive_scaling_uneven_tokens = ec.register_case(dataclasses.replace(
    tokens,
    name="naive_scaling_uneven_tokens",
    regimes=("full_batch", "accumulate:chunks=4", "naive_accumulate:chunks=4"),
    expect_mismatch={"naive_accumulate": "equal chunks of 3 samples hold unequal numbers of real tokens"},
    description="negative control: micro-batch mean / K with uneven token counts",
))

pipeline_uneven_tokens = ec.register_case(dataclasses.replace(
    tokens,
    name="pipeline_uneven_tokens",
    regimes=("full_batch", "pipeline:stages=2,microbatches=4", "pipeline:stages=2,microbatches=4,schedule=1f1b",
             "pipeline_mean_loss:stages=2,microbatches=4", "pipeline_scaled_twice:stages=2,microbatches=4"),
    expect_mismatch={
        "pipeline_mean_loss": "micro-batch means averaged by scale_grads=True: equal micro-batches of 3 samples "
                              "hold unequal numbers of real tokens",
        "pipeline_scaled_twice": "the global-sum loss divided by K again by scale_grads=True: 1/4 of every gradient",
    },
    description="negative control: pipeline stages (torch.distributed.pipelining) with the loss normalised per "
                "micro-batch, over sequences of 1 to 7 real tokens",
))

# The catalogue's entries that use these cases.
add_entry(Entry("naive scaling: micro-batch mean / K, uneven token counts", "naive_scaling_uneven_tokens",
                "naive_accumulate:chunks=4"))
add_entry(Entry("pipeline: micro-batch mean loss with scale_grads=True, uneven token counts",
                "pipeline_uneven_tokens", "pipeline_mean_loss:stages=2,microbatches=4"))
add_entry(Entry("pipeline: global-sum loss scaled again by scale_grads=True", "pipeline_uneven_tokens",
                "pipeline_scaled_twice:stages=2,microbatches=4"))
