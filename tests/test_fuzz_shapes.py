"""Property tests over the drawn attention LMs' 2025-2026 shapes (issue 67): RL objectives aggregated as the trainers
aggregate them, LoRA adapters on a frozen MLP, packed documents. Faithful regimes stay equivalent for every draw; each
shape's pitfall is caught for every draw where it has an effect."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.strategies import attention_cases, batch_sizes, chunkings

SEQUENCE_MEANS = [mode for mode in ec.AGGREGATIONS if mode.startswith("seq-mean")]  # one unit a sequence
SMALL = {"batch_sizes": batch_sizes(3, 12), "steps": st.integers(1, 2)}


@given(case=attention_cases(aggregations=st.sampled_from(SEQUENCE_MEANS), packed=st.just(False), **SMALL),
       data=st.data())
def test_rl_objectives_stay_equivalent_under_accumulation_and_a_mean_of_micro_batch_means_is_caught(case, data):
    """Each sequence one unit: over uneven micro-batches the mean of their means weighs sequences unequally."""
    chunks = data.draw(chunkings(case.batch_size, uneven=True), label="chunks")
    declared = dataclasses.replace(case, expect_mismatch={"naive_accumulate": "the mean of micro-batch means"})
    faithful, naive = ec.check(declared, [f"accumulate:chunks={chunks}", f"naive_accumulate:chunks={chunks}"]).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()
    assert naive.verdict is Verdict.EXPECTED_MISMATCH and naive.comparison.margin > 10, naive.describe()


@given(case=attention_cases(adapters=st.just(True), **SMALL), data=st.data())
def test_adapted_lms_stay_equivalent_and_their_frozen_base_never_moves(case, data):
    chunks = data.draw(chunkings(case.batch_size), label="chunks")
    model = case.model()
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".base." in name for name in frozen)
    (outcome,) = ec.check(case, [f"accumulate:chunks={chunks}"]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


@given(case=attention_cases(packed=st.just(True), aggregations=st.just(""), **SMALL), data=st.data())
def test_packed_documents_stay_equivalent_packed_in_micro_batches_of_rows(case, data):
    """The packing pitfalls' twins are in tests/test_packing.py and the bench: a drawn label across a boundary can
    name the very token it replaces (vocabularies of 3), so it is no property of every draw."""
    chunks = data.draw(st.integers(1, 3), label="chunks")
    (faithful,) = ec.check(case, [f"packed:chunks={chunks}"]).outcomes
    assert faithful.verdict is Verdict.EQUIVALENT, faithful.describe()


def test_the_drawn_lms_reach_every_new_shape():
    """In 200 draws: every aggregation mode, adapters, packed documents, and the plain LM besides."""
    specs = []

    @settings(max_examples=300)
    @given(case=attention_cases())
    def collect(case):
        specs.append(case.name)

    collect()
    assert any(any(f"_{mode}" in name for mode in ec.AGGREGATIONS) for name in specs)
    assert any("_lora" in name for name in specs) and any("_packed" in name for name in specs)
    assert any(not any(mark in name for mark in ("_lora", "_packed", "-mean")) for name in specs)
    assert torch.is_tensor(next(iter(attention_cases().example().data())))
