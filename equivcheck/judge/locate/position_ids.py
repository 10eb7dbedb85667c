"""Documents told by their position ids, where a packed run feeds its model token ids and position ids apart.

transformers' packing feeds ``input_ids``, ``position_ids`` that restart at 0 for each document, perhaps a 2-D
``attention_mask``, and no documents layout; a document is a run of positions counting 0, 1, ... (the test
transformers' masking makes). Here a forward's first integer input is its token ids, a later one of that shape whose
every row counts so its position ids, one of 0s and 1s its attention mask (0: a padding slot, in no document). Each
run's documents, in the order its forwards fed them (the candidate's ranks in rank order), are matched in order to the
reference's by their tokens, one for one: the same tokens, or one more (a document fed whole, its last token an input
too, as packing collators feed it: the slot only one run fed is read in that run's gradients alone, as no gradient in
the other's, since the other computed no loss there). A row's tail of unmasked positions of 0 after its first
document is padding. Where the candidate's documents are not the reference's, or it fed no position ids, nothing is
read and that is said.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from ...trace import StepTrace

Fed = tuple[Tensor, Tensor | None, Tensor | None]  # a forward's token ids, position ids, attention mask (rows, slots)
Run = tuple[int, int, int, int]  # a document's forward, row, first slot and slot past its last


@dataclasses.dataclass(frozen=True)
class Told:
    """Every run's traces, each forward's integer inputs its token ids and position ids alone (an attention mask
    says nothing more once its padding is read out, and the other run may feed none), and each forward's reading:
    its slots (rows, length), the flat indices of its activations' slots and of its gradients' (-1: none here)."""

    traces: list[StepTrace]
    readings: list[list[tuple[tuple[int, int], Tensor, Tensor]]]


def documents(traces: Sequence[StepTrace]) -> Told | str | None:
    """The reference's (``traces[0]``) and the candidate's ranks' documents told by their position ids; why not where
    the candidate's cannot be; None where there is no call for it (the reference's model takes no position ids, or
    the candidate fed rows of the reference's)."""
    fed = [_fed_ids(trace) for trace in traces]
    if any(found is None for found in fed) or any(positions is None for _, positions, _ in fed[0]):
        return None
    if laid_alike([forward[0] for forward in fed[0]], [[forward[0] for forward in found] for found in fed[1:]]):
        return None
    if any(positions is None for found in fed[1:] for _, positions, _ in found):
        return "the candidate's model was fed no position ids that count 0, 1, ... per document to tell its documents by"
    matched = _matched(fed)
    if matched is None:
        return "the documents the candidate's position ids delimit are not the reference's, in the order they were fed"
    return Told([_ids_alone(trace, found) for trace, found in zip(traces, fed)], _readings(fed, matched))


def _fed_ids(trace: StepTrace) -> list[Fed] | None:
    """Each forward's token ids, position ids (None where it was fed none) and attention mask (None where none), or
    None where a forward was fed no 2-D token ids."""
    found = []
    for call in (call for call in trace.calls if call.module == ""):
        if not call.integers or call.integers[0].dim() != 2:
            return None
        tokens, *rest = call.integers
        alike = [t for t in rest if t.shape == tokens.shape]
        positions = next((t for t in alike if _counts_per_document(t)), None)
        mask = next((t for t in alike if t is not positions and bool(((t == 0) | (t == 1)).all())), None)
        found.append((tokens, positions, mask))
    return found or None


def _counts_per_document(tensor: Tensor) -> bool:
    """Whether every row of ``tensor`` counts 0, 1, ... afresh from each 0 (position ids, one run per document)."""
    if tensor.is_floating_point() or tensor.dtype == torch.bool or not tensor.numel():
        return False
    steps = (tensor[:, 1:] == tensor[:, :-1] + 1) | (tensor[:, 1:] == 0)
    return bool((tensor[:, 0] == 0).all() and steps.all() and tensor.max() > 0)


def laid_alike(reference: list[Tensor], ranks: list[list[Tensor]]) -> bool:
    """Whether every forward of the candidate was fed rows of the reference's (token ids, documents layouts), as they
    are (micro-batches, data shards): its records join as any run's do."""
    whole = torch.cat(reference)
    return all(any(torch.equal(whole[start:start + len(fed)], fed) for start in range(len(whole) - len(fed) + 1))
               for found in ranks for fed in found)


def _matched(fed: list[list[Fed]]) -> list[list[tuple[Run, int, int]]] | None:
    """Each run's documents as (run of slots, document id, tokens shared with the other run's), or None where the
    candidate's documents are not the reference's, one for one in the order they were fed."""
    ours = [(0, run) for run in _runs(fed[0])]
    theirs = [(rank, run) for rank, found in enumerate(fed[1:], 1) for run in _runs(found)]
    if len(ours) != len(theirs):
        return None
    matched: list[list[tuple[Run, int, int]]] = [[] for _ in fed]
    for document, (a, b) in enumerate(zip(ours, theirs)):
        shared = _shared(fed, a, b)
        if not shared:
            return None
        for rank, run in (a, b):
            matched[rank].append((run, document, shared))
    return matched


def _runs(fed: list[Fed]) -> list[Run]:
    """The runs of position ids that count on by one, each a document, in the order they were fed. A masked slot (an
    attention mask's 0) is in none, nor a row's tail of unmasked positions of 0 after its first run: padding."""
    runs = []
    for forward, (_, positions, mask) in enumerate(fed):
        real = torch.ones_like(positions, dtype=torch.bool) if mask is None else mask.bool()
        for row, (counted, kept) in enumerate(zip(positions, real)):
            begins = kept.clone()
            begins[1:] &= (counted[1:] != counted[:-1] + 1) | ~kept[:-1]
            marks = [*torch.nonzero(begins | ~kept).reshape(-1).tolist(), len(counted)]
            found = [(forward, row, start, end) for start, end in zip(marks, marks[1:]) if kept[start]]
            while len(found) > 1 and not counted[found[-1][2]:].any():
                found.pop()  # padding: each slot a one-token run of position 0, up to the row's end
            runs += found
    return runs


def _tokens(fed: list[list[Fed]], document: tuple[int, Run]) -> Tensor:
    rank, (forward, row, start, end) = document
    return fed[rank][forward][0][row, start:end]


def _shared(fed: list[list[Fed]], a: tuple[int, Run], b: tuple[int, Run]) -> int:
    """How many tokens documents ``a`` and ``b`` share where one is the other, or the other and one token more."""
    first, second = _tokens(fed, a), _tokens(fed, b)
    shared = min(len(first), len(second))
    return shared if abs(len(first) - len(second)) <= 1 and torch.equal(first[:shared], second[:shared]) else 0


def _readings(fed: list[list[Fed]], matched: list[list[tuple[Run, int, int]]]
              ) -> list[list[tuple[tuple[int, int], Tensor, Tensor]]]:
    """Each forward's slots and the flat indices its activations and gradients are read at: its documents in the
    order of their ids, each its shared tokens, then for the gradients the slot one run fed beyond them (-1 where
    this run fed none)."""
    longer = {document for found in matched for (_, _, start, end), document, shared in found if end - start > shared}
    readings = []
    for rank, found in enumerate(fed):
        per_forward = []
        for forward, (tokens, _, _) in enumerate(found):
            length = tokens.shape[1]
            activations, gradients = [], []
            for (_, row, start, end), document, shared in sorted(
                    (entry for entry in matched[rank] if entry[0][0] == forward), key=lambda entry: entry[1]):
                slots = list(range(row * length + start, row * length + start + shared))
                activations += slots
                extra = [row * length + start + shared] if end - start > shared else [-1] if document in longer else []
                gradients += slots + extra
            per_forward.append((tuple(tokens.shape), torch.tensor(activations, dtype=torch.long),
                                torch.tensor(gradients, dtype=torch.long)))
        readings.append(per_forward)
    return readings


def _ids_alone(trace: StepTrace, fed: list[Fed]) -> StepTrace:
    """``trace`` with each forward's integer inputs its token ids and position ids alone."""
    forwards = iter(fed)
    return dataclasses.replace(trace, calls=[
        dataclasses.replace(call, integers=list(next(forwards)[:2])) if call.module == "" else call
        for call in trace.calls])
