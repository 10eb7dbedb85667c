"""Seed 002: a GRU decoder stepped token by token, trained with full back-propagation through time.

The hidden state carries the graph from token to token (nothing is detached), so the gradient
reaches every earlier step: what per-token detaching would silently truncate.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

VOCAB, HIDDEN, LENGTH = 12, 10, 5


class Recurrence(nn.Module):
    """Embedding and a GRU cell unrolled one token at a time: the hidden state of every token."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.cell = nn.GRUCell(HIDDEN, HIDDEN)

    def initial_hidden(self, tokens):
        return tokens.new_zeros((len(tokens), HIDDEN), dtype=self.embedding.weight.dtype)

    def step(self, token, hidden):
        """One token: the per_token regimes drive the decoder through this, as seed 002's loop does."""
        return self.cell(self.embedding(token), hidden)

    def forward(self, tokens):
        hidden = self.initial_hidden(tokens)
        states = []
        for t in range(tokens.shape[1]):  # teacher forcing: the input of step t is the true token t
            hidden = self.step(tokens[:, t], hidden)
            states.append(hidden)
        return torch.stack(states, dim=1)


def model():
    return nn.Sequential(Recurrence(), nn.Linear(HIDDEN, VOCAB))


def data():
    sequences = torch.randint(1, VOCAB, (24, LENGTH + 1))
    return sequences[:, :-1], sequences[:, 1:]


gru_decoder = ec.register_case(ec.Case(
    name="gru_decoder",
    model=model,
    data=data,
    loss=lambda logits, targets: F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none"),
    items=lambda targets: targets.numel(),
    batch_size=12,
    steps=2,
    split=lambda m: (m[0], m[1]),
    description="seed 002's decoder: GRU cell stepped per token, full BPTT, loss over every token",
))

gru_detached_hidden = ec.register_case(dataclasses.replace(
    gru_decoder,
    name="gru_detached_hidden",
    regimes=("full_batch", "per_token:detach=0", "per_token:detach=1"),
    expect_mismatch={"per_token:detach=1": "seed 002: the hidden state detached after each token's backward "
                                           "truncates back-propagation through time"},
    description="pitfall: per-token backward with the hidden state detached (seed 002) vs full BPTT",
))

# The catalogue's entries that use these cases.
add_entry(Entry("RNN hidden state detached per token (seed 002)", "gru_detached_hidden", "per_token:detach=1"))
