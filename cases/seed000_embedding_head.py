"""Seed 000: a cheap embedding trunk under a large, memory-hungry head, split for detached_partial."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

VOCAB, DIM = 50, 16


def model():
    trunk = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM // 2), nn.Linear(DIM // 2, VOCAB))
    head = nn.Linear(VOCAB, VOCAB)
    for module in (*trunk, head):
        if isinstance(module, nn.Linear):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
    return nn.Sequential(trunk, head)


def data():
    return torch.randint(0, VOCAB, (24,)), torch.randint(0, VOCAB, (24,))


seed000_embedding_head = ec.register_case(ec.Case(
    name="seed000_embedding_head",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=2,
    split=lambda m: (m[0], m[1]),
    description="seed 000's embedding trunk + vocab x vocab head; detached_partial accumulates the head only",
))
