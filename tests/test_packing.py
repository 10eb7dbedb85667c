"""Packed sequences (issue 67): documents packed several a row, checked against the same documents padded one a row.
Faithful packing is equivalent, with and without micro-batches of rows; each pitfall is caught and located where its
bug acts, its records read per document."""

import importlib

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.errors import InvalidArgument
from equivcheck.judge.locate import documents as per_document_reading
from equivcheck.judge.locate import position_ids
from equivcheck.packing import DOCUMENTS, IGNORE, PADDING, POSITIONS, TOKENS, document_mask, document_order, pack, padded
from equivcheck.trace import ModuleCall, StepTrace
from equivcheck_cases.field._packing import stream
from equivcheck_cases.packing import LENGTH

CASE = "packed_documents"

# where each pitfall parts: (phase, module), read per document
WHERE = {
    "packed_positions_run_on": ("forward", ""),  # the batch the model was fed: its positions, document by document
    "packed_label_across": ("loss", ""),
    "packed_row_mean": ("loss", ""),
}


def small_documents():
    return [torch.tensor(tokens) for tokens in ([1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11])]


def test_padded_puts_one_document_a_row_and_pack_keeps_each_documents_positions_ids_and_targets():
    layout, targets = padded(small_documents(), 3)
    assert layout[:, TOKENS].tolist() == [[1, 2, 0], [4, 0, 0], [6, 7, 8], [10, 0, 0]]
    assert targets.tolist() == [[2, 3, IGNORE], [5, IGNORE, IGNORE], [7, 8, 9], [11, IGNORE, IGNORE]]
    packed, packed_targets = pack(layout, targets, 4)
    assert packed[:, TOKENS].tolist() == [[1, 2, 4, 0], [6, 7, 8, 10]]
    assert packed[:, POSITIONS].tolist() == [[0, 1, 0, 0], [0, 1, 2, 0]]
    assert packed[:, DOCUMENTS].tolist() == [[0, 0, 1, PADDING], [2, 2, 2, 3]]
    assert packed_targets.tolist() == [[2, 3, 5, IGNORE], [7, 8, 9, 11]]
    # both layouts read per document hold the same tokens in the same order
    assert layout[:, TOKENS].reshape(-1)[document_order(layout)].tolist() == \
        packed[:, TOKENS].reshape(-1)[document_order(packed)].tolist()


def test_the_document_mask_is_causal_within_each_document_and_a_padding_slot_sees_itself():
    packed, _ = pack(*padded(small_documents(), 3), 4)
    mask = document_mask(packed)
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_bad_layouts_and_lengths_are_refused_naming_the_argument():
    with pytest.raises(InvalidArgument, match=r"documents\[0\] of 9 tokens is not allowed: expected 2 to 4 "
                                              r"tokens"):
        padded([torch.arange(9)], 3)
    layout, targets = padded(small_documents(), 3)
    with pytest.raises(InvalidArgument, match=r"length=2 is not allowed: expected at least 3"):
        pack(layout, targets, 2)
    with pytest.raises(InvalidArgument, match=r"inputs=a tensor of shape \(4, 3\) \(torch.int64\) with targets=a "
                                              r"tensor of shape \(4, 3\) \(torch.int64\) is not allowed: expected "
                                              r"a documents layout"):
        pack(layout[:, 0], targets)
    with pytest.raises(InvalidArgument, match="length=-1 is not allowed"):
        ec.check(CASE, ["packed:length=-1"])


def test_faithful_packing_is_equivalent_and_each_pitfall_is_caught_where_its_bug_acts():
    faithful_regimes = ["packed", "packed:chunks=2", "packed:length=12", "accumulate:chunks=3", "ddp:world_size=2"]
    report = ec.check(CASE, [*faithful_regimes, *WHERE], locate=True)
    outcomes = {o.regime: o for o in report.outcomes}
    for faithful in faithful_regimes:
        assert outcomes[faithful].verdict is Verdict.EQUIVALENT, outcomes[faithful].describe()
    for pitfall, (phase, module) in WHERE.items():
        outcome = outcomes[pitfall]
        assert outcome.verdict is Verdict.EXPECTED_MISMATCH, outcome.describe()
        assert outcome.location is not None, outcome.describe()
        assert (outcome.location.phase, outcome.location.module) == (phase, module), outcome.describe()
        assert per_document_reading.READ_PER_DOCUMENT in outcome.location.matched, outcome.location
    assert "document by document, the positions it was fed differ" in \
        outcomes["packed_positions_run_on"].location.matched


def test_an_attention_that_drops_the_document_mask_is_right_padded_and_caught_packed_in_the_attention():
    outcomes = {o.regime: o for o in ec.check("packed_documents_causal_only", ["accumulate:chunks=3", "packed"],
                                              locate=True).outcomes}
    assert outcomes["accumulate:chunks=3"].verdict is Verdict.EQUIVALENT  # padded rows: causality hides the padding
    caught = outcomes["packed"]
    assert caught.verdict is Verdict.EXPECTED_MISMATCH, caught.describe()
    assert (caught.location.phase, caught.location.module, caught.location.own_code) == ("forward", "attention", True)


def test_packed_rows_pack_several_documents_a_row():
    case = ec.get_case(CASE)
    batch_inputs, batch_targets = (t[:case.batch_size] for t in case.data())
    packed, _ = pack(batch_inputs, batch_targets)
    assert len(packed) < len(batch_inputs)  # fewer rows than documents: packing really happened
    assert int((packed[:, DOCUMENTS] != PADDING).sum()) == int((batch_inputs[:, DOCUMENTS] != PADDING).sum())


def test_without_the_per_document_reading_the_packed_pitfalls_are_not_located_in_their_module(monkeypatch):
    """The reading's own test: with it taken out, the attention pitfall's records never meet the reference's."""
    monkeypatch.setattr(per_document_reading, "per_document", lambda reference, ranks: (reference, list(ranks), ""))
    (outcome,) = ec.check("packed_documents_causal_only", ["packed"], locate=True).outcomes
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH
    assert outcome.location is None or outcome.location.module != "attention", outcome.location


# transformers' packing: token ids and position ids apart, no documents layout (cases/field/_packing.py's model)

def _located(module_name: str):
    (outcome,) = importlib.import_module(f"equivcheck_cases.field.{module_name}").buggy().outcomes
    assert outcome.verdict is Verdict.MISMATCH, outcome.describe()
    return outcome.location


@pytest.mark.usefixtures("locating")
def test_documents_told_by_their_position_ids_are_read_per_document_and_a_label_across_is_located_at_the_loss():
    """torchtitan#4075's stream: each document fed whole (its last token an input, labelled with the next document's
    first); the reference padded one a row with a 2-D mask. Read per document, every activation matches and the
    loss's gradient at the slot only the packed run fed parts."""
    location = _located("torchtitan_4075")
    assert (location.phase, location.module) == ("loss", ""), location
    assert per_document_reading.READ_BY_POSITIONS in location.matched, location


@pytest.mark.usefixtures("locating")
def test_without_the_documents_told_by_position_ids_the_label_across_is_located_at_the_batch_fed(monkeypatch):
    """The reading's own test: taken out, the packed rows are only rows that do not make up the global batch's."""
    monkeypatch.setattr(position_ids, "documents", lambda traces: None)
    location = _located("torchtitan_4075")
    assert (location.phase, location.tensor) == ("forward", "the batch the model was fed"), location


@pytest.mark.usefixtures("locating")
def test_a_slot_only_one_run_fed_is_read_in_its_gradients_not_left_out(monkeypatch):
    """Leaving the document's extra slot out of the gradients too hides the very label that parts: the run would be
    said to part in a parameter's gradient, every record read matching."""
    documents = position_ids.documents

    def extra_slots_left_out(traces):
        told = documents(traces)
        return told if not isinstance(told, position_ids.Told) else position_ids.Told(
            told.traces, [[(slots, activations, activations) for slots, activations, _ in run] for run in told.readings])

    monkeypatch.setattr(position_ids, "documents", extra_slots_left_out)
    location = _located("torchtitan_4075")
    assert location.phase != "loss", location


@pytest.mark.usefixtures("locating")
def test_position_ids_that_do_not_count_per_document_say_why_the_records_are_not_read():
    """LlamaFactory#7754: a mask [1, 1, 2, 2, 2, 0] fed as positions: no run counts 0, 1, ... per document."""
    location = _located("llamafactory_7754")
    assert location.phase == "forward", location
    assert f"{per_document_reading.NOT_READ}: the candidate's model was fed no position ids" in location.matched


def _trace(*forwards):
    return StepTrace(0, 0, [ModuleCall("", index, [], [], integers=list(fed)) for index, fed in enumerate(forwards)],
                     [], {}, {}, {}, [])


def test_documents_are_matched_in_order_fed_whole_or_not_and_a_rows_tail_of_positions_of_0_is_padding():
    """The reference padded one a row under a mask; the candidate packs them whole (one token more each), each row
    ending in an unmasked position 0 whose token opens the next document: padding, not that document."""
    ids, positions = torch.tensor([[3, 4, 0, 0], [0, 5, 0, 0]]), torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])
    packed_ids, packed_positions = torch.tensor([[3, 4, 9, 0], [0, 5, 6, 0]]), torch.tensor([[0, 1, 2, 0], [0, 1, 2, 0]])
    told = position_ids.documents([_trace((ids, positions, mask)), _trace((packed_ids, packed_positions))])
    assert isinstance(told, position_ids.Told), told
    (ours,), (theirs,) = told.readings
    assert ours[1].tolist() == [0, 1, 4, 5] and theirs[1].tolist() == [0, 1, 4, 5]
    assert ours[2].tolist() == [0, 1, -1, 4, 5, -1] and theirs[2].tolist() == [0, 1, 2, 4, 5, 6]
    assert [len(call.integers) for call in told.traces[0].calls] == [2]  # the mask said all it had to say
    other = torch.tensor([[3, 4, 9, 0], [0, 7, 6, 0]])
    assert "not the reference's" in position_ids.documents([_trace((ids, positions, mask)),
                                                            _trace((other, packed_positions))])
    assert position_ids.documents([_trace((ids, positions, mask)), _trace((ids[1:], positions[1:]))]) is None


@settings(max_examples=200, deadline=None)
@given(documents=st.lists(st.integers(2, LENGTH + 1), min_size=1, max_size=12).flatmap(
    lambda lengths: st.tuples(*(st.lists(st.integers(0, 2), min_size=n, max_size=n) for n in lengths))),
       masked=st.booleans())
def test_documents_packed_whole_are_told_by_their_position_ids_token_for_token(documents, masked):
    """Any documents (of tokens 0 to 2: padding's token 0 opens many), padded one a row (under a mask, or not: then
    each padding slot is a one-token run of position 0) and packed whole as collators pack them: each document is
    matched to itself, every input token read in both runs, the packed run's extra slot in its gradients alone."""
    assume(any(len(document) > 2 for document in documents))  # position ids of 0 alone count nothing
    layout, targets = padded([torch.tensor(document) for document in documents], LENGTH)
    mask = (layout[:, DOCUMENTS] != PADDING).long()
    ids, positions = layout[:, TOKENS], layout[:, POSITIONS]
    packed_ids, packed_positions, _ = stream(layout, targets)
    told = position_ids.documents([_trace((ids, positions, mask) if masked else (ids, positions)),
                                   _trace((packed_ids, packed_positions))])
    assert isinstance(told, position_ids.Told), told
    (ours,), (theirs,) = told.readings
    inputs = sum(len(document) - 1 for document in documents)
    assert len(ours[1]) == len(theirs[1]) == inputs
    assert torch.equal(ids.reshape(-1)[ours[1]], packed_ids.reshape(-1)[theirs[1]])
    assert torch.equal(ids.reshape(-1)[ours[1]], torch.cat([torch.tensor(document[:-1]) for document in documents]))
    assert int((ours[2] < 0).sum()) == len(documents) and bool((theirs[2] >= 0).all())
