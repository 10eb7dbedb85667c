"""Regime specs and the mathematics of each regime, including uneven chunkings drawn by hypothesis."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import equivcheck as ec
from equivcheck.process import seeding
from equivcheck import Verdict
from equivcheck.regimes import Accumulate, DetachedPartial


@pytest.mark.parametrize("spec", ["full_batch", "sample_by_sample", "accumulate:chunks=4", "retained_graph:chunks=1",
                                  "detached_partial:chunks=12", "naive_accumulate:chunks=5"])
def test_specs_round_trip(spec):
    regime = ec.parse_regime(spec)
    assert str(regime) == spec and ec.parse_regime(str(regime)) == regime


def test_specs_parse_to_frozen_dataclasses():
    assert ec.parse_regime(" accumulate:chunks=04 ") == Accumulate(chunks=4)
    assert ec.parse_regime("accumulate:chunks=4") != DetachedPartial(chunks=4)
    with pytest.raises(AttributeError):
        Accumulate(chunks=4).chunks = 5


def test_uneven_chunks_keep_every_sample_once_in_order():
    from equivcheck.regimes import chunk_pairs
    from equivcheck.runners.train import load_batches

    with seeding.seeded():
        batch = load_batches(ec.get_case("mlp"))[0]
    pairs = chunk_pairs(batch, 5)
    assert [len(x) for x, _ in pairs] == [3, 3, 2, 2, 2] and all(len(x) == len(y) for x, y in pairs)
    assert torch.equal(torch.cat([x for x, _ in pairs]), batch.inputs)
    assert torch.equal(torch.cat([y for _, y in pairs]), batch.targets)


@given(case=st.sampled_from(["mlp", "tokens", "gru_decoder", "seed000_embedding_head", "cnn"]),
       kind=st.sampled_from(["accumulate", "retained_graph", "detached_partial"]),
       chunks=st.integers(1, 12))
def test_faithful_regimes_hold_for_every_chunking(case, kind, chunks):
    (outcome,) = ec.check(case, [f"{kind}:chunks={chunks}"]).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT, outcome.describe()


@given(chunks=st.integers(2, 12).filter(lambda k: 12 % k != 0))
def test_naive_scaling_is_caught_for_every_uneven_chunking(chunks):
    (outcome,) = ec.check("naive_scaling_uneven_chunks", [f"naive_accumulate:chunks={chunks}"]).outcomes
    assert outcome.verdict is ec.Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 100


def test_a_spec_is_shown_as_typed_required_parameters_by_kind_optional_ones_with_defaults():
    assert ec.regimes.spec_usage("sample_by_sample") == "sample_by_sample"
    assert ec.regimes.spec_usage("full_batch") == "full_batch[:max_norm=inf]"
    assert ec.regimes.spec_usage("accumulate") == "accumulate:chunks=N[,max_norm=inf]"
    assert ec.regimes.spec_usage("ddp_mean_loss") == "ddp_mean_loss:world_size=N[,backend=auto]"
    assert ec.regimes.spec_usage("ddp").endswith(",broadcast_buffers=1,find_unused_parameters=0]")  # bools as 0/1
    assert ec.regimes.spec_usage("ddp_hook").startswith("ddp_hook:world_size=N,hook=NAME[,backend=auto,")


OWN_FORWARD = ec.Case(
    name="own_forward", model=lambda: torch.nn.Linear(4, 3),
    data=lambda: (torch.randn(12, 4), torch.randint(0, 3, (12,))),
    loss=lambda output, target: torch.nn.functional.cross_entropy(output, target, reduction="none"),
    batch_size=6, steps=2,
    forward=lambda model, x, y: model(x) + 0 * y[:, None],  # a model that needs its targets (computing its own loss)
)


@pytest.mark.parametrize("regime", ["sample_by_sample", "accumulate:chunks=3", "retained_graph:chunks=3",
                                    "summed_loss:chunks=3"])
def test_every_regime_hands_the_targets_to_a_cases_own_forward(regime):
    (outcome,) = ec.check(OWN_FORWARD, [regime]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


def test_a_clipped_reference_and_regime_clip_at_their_threshold_and_only_they_do():
    assert ec.parse_regime("accumulate:chunks=3,max_norm=0.1").clips_at() == 0.1
    assert ec.parse_regime("full_batch:max_norm=0.1").clips_at() == 0.1
    assert ec.parse_regime("accumulate:chunks=3").clips_at() is ec.parse_regime("full_batch").clips_at() is None
    clipped, unclipped = ec.check("mlp", ["accumulate:chunks=3,max_norm=0.1", "accumulate:chunks=3"],
                                  reference="full_batch:max_norm=0.1").outcomes
    assert clipped.verdict is Verdict.EQUIVALENT and unclipped.verdict is Verdict.MISMATCH
    assert clipped.reason.startswith("full_batch:max_norm=0.1: clipping engaged at 3 of 3 steps")


def test_more_chunks_than_samples_is_a_usage_error_naming_the_regime_and_the_case():
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.check("mlp", ["accumulate:chunks=13"])
    assert str(raised.value) == ("regime 'accumulate:chunks=13' on case 'mlp': chunks=13 is not allowed: expected an "
                                 "integer from 1 to 12 (the case's batch_size)")
