"""The documents layout: a batch of token documents as one tensor, padded one document a row or packed several a row.

A case's inputs are ``(rows, 3, length)`` integers: each slot's token id, its position within its document, and its
document's id (:data:`PADDING`, -1, in a slot that holds none); its targets ``(rows, length)`` the next token of each
slot's document (:data:`IGNORE` where there is none). Padded (:func:`padded`), row ``i`` holds document ``i`` from
slot 0; packed (:func:`pack`, what the ``packed`` regime feeds the model), each row holds documents one after
another, each keeping its positions, its id and its targets. A model that attends within a slot's document
(:func:`document_mask`) and embeds each slot's own position computes every document's tokens alike in both, so a
token-mean loss and every gradient are the padded batch's: packing is faithful exactly where that holds.

The localizer reads a run's records per document (equivcheck.judge.locate.documents): every record whose leading
dimensions are the run's slots, its real slots in :func:`document_order`, which both layouts share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .errors import InvalidArgument

TOKENS, POSITIONS, DOCUMENTS = 0, 1, 2  # the channels of a layout's dimension 1
PADDING = -1  # the document id of a slot that holds no document's token
IGNORE = -100  # the target of a slot whose token has no next one to learn (torch's cross_entropy ignore_index)


def padded(documents: Sequence[Tensor], length: int, pad: int = 0) -> tuple[Tensor, Tensor]:
    """``documents`` (1-D token tensors of 2 to ``length + 1`` tokens: a document's every token but its last is an
    input, every one but its first a target) one a row: the layout and its targets. Document ``i`` has id ``i``."""
    rows = len(documents)
    layout = torch.full((rows, 3, length), pad, dtype=torch.long)
    layout[:, POSITIONS], layout[:, DOCUMENTS] = 0, PADDING
    targets = torch.full((rows, length), IGNORE, dtype=torch.long)
    for row, document in enumerate(documents):
        tokens = len(document) - 1
        if not 1 <= tokens <= length:
            raise InvalidArgument(f"documents[{row}] of {len(document)} tokens is not allowed: expected 2 to "
                                  f"{length + 1} tokens (length={length} inputs a row, and a document's last token "
                                  "is its last input's target)")
        layout[row, TOKENS, :tokens], targets[row, :tokens] = document[:-1], document[1:]
        layout[row, POSITIONS, :tokens], layout[row, DOCUMENTS, :tokens] = torch.arange(tokens), row
    return layout, targets


def expect_layout(layout: Tensor, targets: Tensor, argument: str = "inputs") -> None:
    """Raise :class:`InvalidArgument` unless ``layout`` and ``targets`` are a documents layout."""
    if not (isinstance(layout, Tensor) and layout.dim() == 3 and layout.shape[1] == 3 and not layout.is_floating_point()
            and isinstance(targets, Tensor) and targets.shape == (layout.shape[0], layout.shape[2])):
        raise InvalidArgument(f"{argument}={_shape(layout)} with targets={_shape(targets)} is not allowed: expected a "
                              "documents layout, (rows, 3, length) integers (token ids, positions, document ids, -1 "
                              "where no document) with targets of shape (rows, length) (equivcheck.packing.padded "
                              "builds it)")


def pack(layout: Tensor, targets: Tensor, length: int = 0) -> tuple[Tensor, Tensor]:
    """The documents of a (padded or packed) layout packed into rows of ``length`` slots (0: the layout's own), one
    after another in the order they come (next fit: a document that does not fit the row's free slots starts the
    next row), each keeping its tokens, positions, id and targets; the slots left over are padding."""
    expect_layout(layout, targets)
    length = length or layout.shape[2]
    documents = _documents(layout, targets)
    longest = max((targets.numel() for _, targets in documents), default=0)
    if longest > length:
        raise InvalidArgument.value("length", length, f"at least {longest}, the longest document's tokens")
    rows: list[list[tuple[Tensor, Tensor]]] = [[]]
    free = length
    for document in documents:
        tokens = document[1].numel()
        if tokens > free:
            rows.append([])
            free = length
        rows[-1].append(document)
        free -= tokens
    packed = torch.zeros((len(rows), 3, length), dtype=layout.dtype, device=layout.device)
    packed[:, DOCUMENTS] = PADDING
    packed_targets = torch.full((len(rows), length), IGNORE, dtype=targets.dtype, device=targets.device)
    for row, held in enumerate(rows):
        slot = 0
        for slots, document_targets in held:
            packed[row, :, slot:slot + slots.shape[1]] = slots
            packed_targets[row, slot:slot + slots.shape[1]] = document_targets
            slot += slots.shape[1]
    return packed, packed_targets


def _documents(layout: Tensor, targets: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Each document's slots ``(3, tokens)`` and targets, in the order of their ids."""
    order = document_order(layout)
    ids = layout[:, DOCUMENTS].reshape(-1)[order]
    slots = layout.permute(1, 0, 2).reshape(3, -1)[:, order]
    flat_targets = targets.reshape(-1)[order]
    bounds = torch.nonzero(ids[1:] != ids[:-1]).reshape(-1) + 1
    starts, ends = [0, *bounds.tolist()], [*bounds.tolist(), len(ids)]
    return [(slots[:, start:end], flat_targets[start:end]) for start, end in zip(starts, ends)]


def document_order(layout: Tensor) -> Tensor:
    """The flat indices of ``layout``'s real slots (``rows * length`` of them in all), ordered by document id, then
    position: the same tokens in the same order whatever rows the documents were laid out in."""
    ids, positions = layout[:, DOCUMENTS].reshape(-1), layout[:, POSITIONS].reshape(-1)
    real = torch.nonzero(ids != PADDING).reshape(-1)
    key = ids[real] * (int(positions.max()) + 1 if positions.numel() else 1) + positions[real]
    return real[torch.argsort(key, stable=True)]


def document_mask(layout: Tensor) -> Tensor:
    """``(rows, length, length)``: where a slot may attend, causally and within its own document (a padding slot to
    itself alone, so that no row of scores is empty)."""
    ids = layout[:, DOCUMENTS]
    slots = layout.shape[2]
    causal = torch.ones(slots, slots, dtype=torch.bool, device=layout.device).tril()
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != PADDING)
    return (same & causal) | torch.eye(slots, dtype=torch.bool, device=layout.device)


def is_layout(tensor: object) -> bool:
    """Whether ``tensor`` is shaped and typed as a documents layout (a run's root input, as the localizer reads it)."""
    return isinstance(tensor, Tensor) and tensor.dim() == 3 and tensor.shape[1] == 3 and not tensor.is_floating_point()


def _shape(value: object) -> str:
    return f"a tensor of shape {tuple(value.shape)} ({value.dtype})" if isinstance(value, Tensor) else repr(value)
