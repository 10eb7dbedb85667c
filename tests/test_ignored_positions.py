"""Torch's own per-token loss: ``reduction='none'`` with ``ignore_index`` keeps every position, 0 where a label is
ignored. With ``items=`` counting the real labels it is accepted flat ``(samples * tokens,)`` or as
``(samples, tokens)``: the objective is the sum over the global batch's items over their count, the zeros add
nothing. A loss that is not 0 where items= counts nothing is refused, naming the positions."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict

VOCAB, TOKENS = 7, 5


def make_model():
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def make_data():
    """Padding that differs per sample, so micro-batches hold uneven counts of real labels."""
    tokens, labels = torch.randint(VOCAB, (24, TOKENS)), torch.randint(VOCAB, (24, TOKENS))
    for sample in range(24):
        labels[sample, TOKENS - sample % 5:] = -100
    return tokens, labels


def flat_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)


def per_sample_loss(logits, labels):
    return flat_loss(logits, labels).view(labels.shape)


def real_labels(labels):
    return (labels != -100).sum()


FLAT = ec.register_case(ec.Case(name="ignore_index_flat", model=make_model, data=make_data, loss=flat_loss,
                                items=real_labels, batch_size=12, steps=2))
SHAPED = ec.register_case(dataclasses.replace(FLAT, name="ignore_index_shaped", loss=per_sample_loss))


@pytest.mark.parametrize("case", [FLAT, SHAPED], ids=["flat", "samples_by_tokens"])
def test_torchs_per_token_loss_with_ignored_labels_is_equivalent_under_every_cut(case):
    report = ec.check(case, ["accumulate:chunks=3", "sample_by_sample", "ddp:world_size=2",
                             "naive_accumulate:chunks=3"])
    verdicts = {outcome.regime: outcome.verdict for outcome in report.outcomes}
    assert verdicts == {"accumulate:chunks=3": Verdict.EQUIVALENT, "sample_by_sample": Verdict.EQUIVALENT,
                        "ddp:world_size=2": Verdict.EQUIVALENT, "naive_accumulate:chunks=3": Verdict.MISMATCH}
    assert report.outcomes[-1].comparison.margin > 100  # a mean per micro-batch weighs real labels unevenly


def test_the_objective_is_torchs_own_mean_over_the_real_labels():
    """The same run as a case whose loss is torch's reduction='mean' with ignore_index: zeros count as no item."""
    def torch_mean(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    mean = dataclasses.replace(FLAT, name="ignore_index_mean", loss=torch_mean, loss_reduction="mean")
    comparison = ec.compare(ec.run(mean, "full_batch"), ec.run(FLAT, "full_batch"))
    assert comparison.ok and comparison.max_rel < 1e-13


def test_a_loss_not_zero_where_items_counts_nothing_is_refused_naming_the_positions():
    def smoothed(logits, labels):  # the ignored labels clamped to a real class: every position holds a loss
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")

    planted = dataclasses.replace(FLAT, name="ignore_index_not_zero", loss=smoothed)
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.run(planted, "full_batch")
    message = str(raised.value)
    assert "the 21 positions items= leaves out must hold a loss of 0" in message
    assert "(sample 1, position 4)" in message
