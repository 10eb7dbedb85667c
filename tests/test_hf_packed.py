"""Packed sequences on a model equivcheck did not write (issue 67): Transformers' own LlamaForCausalLM, built from a
config (no download), fed the built-in packed documents as transformers' packing feeds them: token ids and
``position_ids`` that restart at each document, no attention mask (transformers finds the documents from the
position ids), each document whole; the reference pads one document a row under a 2-D mask. Faithful packing is
equivalent; labels shifted over the packed stream (pytorch/torchtitan#4075's bug) are caught and located at the
loss, the records read per document by their position ids. Measured with transformers 5.23.0: a packed forward that
leaves ``use_cache`` at the config's default builds a cache, and transformers looks for packed documents only where
no cache is passed, so each document attends to the ones before it in its row: caught in the first attention."""

import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: `make test-frameworks` installs it")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import equivcheck as ec  # noqa: E402
from equivcheck import Verdict  # noqa: E402
from equivcheck.judge.locate import documents  # noqa: E402
from equivcheck.packing import DOCUMENTS, PADDING, POSITIONS, TOKENS  # noqa: E402
from equivcheck_cases.field._packing import stream, token_mean_step  # noqa: E402
from equivcheck_cases.packing import BATCH_SIZE, LENGTH, VOCAB, token_losses, real_tokens  # noqa: E402
from equivcheck_cases.packing import documents as packed_documents  # noqa: E402

pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def tiny_llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=LENGTH + 2, tie_word_embeddings=True,
                                        attn_implementation="sdpa"))


def padded(model, layout, targets):
    """The reference: each document alone in its row, its padding masked."""
    return model(layout[:, TOKENS], attention_mask=(layout[:, DOCUMENTS] != PADDING).long(),
                 position_ids=layout[:, POSITIONS]).logits


CASE = ec.Case(name="tiny_llama_documents", model=tiny_llama, data=packed_documents, loss=token_losses,
               items=real_tokens, forward=padded, batch_size=BATCH_SIZE, steps=2)


def packed_step(model, optimizer, batch, label_across=False, use_cache=False):
    """The team's step: the global batch's documents packed whole into rows, one token-mean step."""
    def packed_forward(input_ids, position_ids, _):
        return model(input_ids, position_ids=position_ids, use_cache=use_cache).logits

    return token_mean_step(packed_forward, optimizer, *stream(*batch, label_across=label_across))


def labels_across(model, optimizer, batch):
    return packed_step(model, optimizer, batch, label_across=True)


def cache_left_on(model, optimizer, batch):
    return packed_step(model, optimizer, batch, use_cache=True)


def test_packing_a_llama_as_transformers_does_is_equivalent_to_padding_it():
    (outcome,) = ec.check_step(CASE, packed_step).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


def test_labels_across_documents_on_a_packed_llama_are_caught_and_located_at_the_loss():
    (outcome,) = ec.check_step(CASE, labels_across).outcomes
    assert outcome.verdict is Verdict.MISMATCH, outcome.describe()
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "loss", ""), outcome.describe()
    assert documents.READ_BY_POSITIONS in location.matched, location


def test_a_packed_forward_that_builds_a_cache_attends_across_documents_and_is_caught_in_the_first_attention():
    (outcome,) = ec.check_step(CASE, cache_left_on).outcomes
    assert outcome.verdict is Verdict.MISMATCH, outcome.describe()
    location = outcome.location
    assert (location.step, location.phase, location.module) == (0, "forward", "model.layers.0.self_attn"), \
        outcome.describe()
    assert documents.READ_BY_POSITIONS in location.matched, location
