"""Seed 003: 2-rank DDP with one step per batch equals one process accumulating 2 batches per step.

The article's model is one bias-free linear unit with weight 1 whose loss is the *sum* of its
outputs over a rank's 4 rows; DDP averages the 2 ranks. Per row, that is 4/8 of its output: the
per-item loss below, so that equivcheck's mean over the 8 rows of a global batch is the article's
loss. Its data is torch.rand(8, 8) under seed 0, and both epochs see the same 8 rows.
"""

import torch
from torch import nn

import equivcheck as ec

ROWS, RANKS = 8, 2
ROWS_PER_RANK = ROWS // RANKS


def model():
    linear = nn.Linear(ROWS, 1, bias=False)
    nn.init.ones_(linear.weight)
    return linear


def data():
    rows = torch.rand(ROWS, ROWS, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    epochs = rows.repeat(2, 1)
    return epochs, torch.zeros(len(epochs))


# The article's printed final weights, after 2 epochs on either path.
ARTICLE_WEIGHTS = (0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186)

seed003_article = ec.register_case(ec.Case(
    name="seed003_article",
    model=model,
    data=data,
    loss=lambda output, _: output.reshape(-1) * ROWS_PER_RANK,
    batch_size=ROWS,
    steps=2,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    regimes=("full_batch", "accumulate:chunks=2", "ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=2"),
    description="seed 003's article: DDP over 2 ranks = accumulating 2 batches; its printed weights asserted",
))
