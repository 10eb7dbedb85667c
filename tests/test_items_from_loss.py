"""A per-token loss without items=: its count is read off the loss (one item per element), in a forward
that changes no random draw; a loss with ignored padding must still say how many items count."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict

VOCAB, TOKENS = 7, 5


class Tokens(nn.Module):
    """Embedding and a vocabulary head; with ``noise``, a layer between them that draws in every mode
    (eval too), so a forward the harness added would shift every later draw."""

    def __init__(self, noise=0.0):
        super().__init__()
        self.embed, self.head, self.noise = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB), noise

    def forward(self, tokens):
        hidden = self.embed(tokens)
        return self.head(hidden + self.noise * torch.randn_like(hidden) if self.noise else hidden)


def data(padding=False):
    tokens = torch.randint(VOCAB, (24, TOKENS))
    targets = torch.randint(VOCAB, (24, TOKENS))
    if padding:
        targets[::3, -2:] = -100
    return tokens, targets


def per_token(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # shape (samples, tokens)


CASE = ec.Case(name="per_token_loss", model=Tokens, data=data, loss=per_token, batch_size=12, steps=2)
NOISY = dataclasses.replace(CASE, name="per_token_noisy", model=lambda: Tokens(noise=1e-2))
DECLARED = dataclasses.replace(NOISY, name="per_token_noisy_declared", items=lambda targets: targets.numel())


def test_a_per_token_loss_is_counted_by_its_elements_and_nothing_it_draws_changes():
    """The same numbers as the case that declares items=: the probe forward (which draws noise here) was
    undone, so the run's own draws are those of a run without it."""
    for spec in ("full_batch", "accumulate:chunks=4", "sample_by_sample"):
        counted, declared = ec.run(NOISY, spec), ec.run(DECLARED, spec)
        assert ec.compare(declared, counted).margin == 0, spec


def test_every_faithful_regime_matches_and_the_naive_mean_is_still_caught():
    report = ec.check(CASE, ["accumulate:chunks=4", "retained_graph:chunks=3", "naive_accumulate:chunks=5"])
    verdicts = [o.verdict for o in report.outcomes]
    assert verdicts[:2] == [Verdict.EQUIVALENT, Verdict.EQUIVALENT]
    # 12 samples in 5 micro-batches (3, 3, 2, 2, 2): a mean of means weighs tokens unevenly
    assert verdicts[2] is Verdict.MISMATCH and report.outcomes[2].comparison.margin > 100


def test_a_loss_with_ignored_padding_must_say_how_many_items_count():
    padded = dataclasses.replace(CASE, name="per_token_padded", data=lambda: data(padding=True))
    with pytest.raises(ec.InvalidArgument, match=r"60 losses for 12 samples, 8 of them exactly 0.*declare items="):
        ec.run(padded, "full_batch")
