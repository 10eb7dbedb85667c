"""A packed run's records read back per document, so that they meet the padded reference's slot for slot.

Where both runs feed their model a documents layout (:mod:`equivcheck.packing`) and the candidate lays the documents
out in other rows than the reference (packed several a row, where the reference pads one a row), no record of an
activation has the reference's shape. Each run's records are then read per document: every record whose leading
dimensions are the slots of the forward it belongs to becomes its real slots in the order of their document and
position, which both layouts share (the model's own layout input, its channels; a record of another shape, an
attention's scores, is left out on both sides). A forward's layout is the model's own integer input of that call; a
module called other than the same number of times in each forward cannot be matched to one, and then the records
stay as they are, the reason said beside the location.

A model fed no documents layout but token ids and position ids apart (transformers' packing) has its documents told by
its position ids (:mod:`.position_ids`); a slot only one run fed (a document fed whole, its last token an input too)
is read in that run's gradients alone, as none in the other's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from ... import packing
from ...trace import ModuleCall, StepTrace
from . import position_ids

READ_PER_DOCUMENT = "read per document (the candidate packs the documents into other rows)"
READ_BY_POSITIONS = "read per document (the candidate packs the documents into other rows; told by their position ids)"
NOT_READ = "its records could not be read per document"
CHANNELS = {packing.TOKENS: "token ids", packing.POSITIONS: "positions", packing.DOCUMENTS: "document ids"}


@dataclasses.dataclass(frozen=True)
class Reading:
    """How one forward's records are read per document: its slots (rows, length), the flat indices of the slots its
    activations are read at, in the order of their document and position, and of those its gradients are read at
    (-1: a slot only the other run fed; no gradient reached it here)."""

    slots: tuple[int, int]
    activations: Tensor
    gradients: Tensor

    @classmethod
    def of(cls, layout: Tensor) -> Reading:
        order = packing.document_order(layout)
        return cls((layout.shape[0], layout.shape[2]), order, order)

    def read(self, record: Tensor | None, gradient: bool = False) -> Tensor | None:
        """``record`` per document, shaped ``(slots read, *rest)``; None where its leading dimensions are not the
        forward's slots (an attention's scores: left out on both sides)."""
        if record is None or record.dim() < 2 or tuple(record.shape[:2]) != self.slots:
            return None
        index = (self.gradients if gradient else self.activations).to(record.device)
        read = record.reshape(-1, *record.shape[2:])[index.clamp(min=0)]
        read[index < 0] = 0
        return read


def per_document(reference: StepTrace, ranks: Sequence[StepTrace]) -> tuple[StepTrace, list[StepTrace], str]:
    """Both runs' traces read per document where the candidate lays the documents out otherwise, with what was done
    (or why it could not be: the traces then stay as they are); unchanged, with "", where there is no call for it."""
    traces = [reference, *ranks]
    layouts = [_layouts(trace) for trace in traces]
    if any(found is None for found in layouts):
        told = position_ids.documents(traces)
        if told is None:
            return reference, list(ranks), ""
        if isinstance(told, str):
            return reference, list(ranks), f"{NOT_READ}: {told}"
        traces, readings, done = told.traces, [[Reading(*forward) for forward in run] for run in told.readings], \
            READ_BY_POSITIONS
    elif position_ids.laid_alike(layouts[0], layouts[1:]):
        return reference, list(ranks), ""
    else:
        readings, done = [[Reading.of(layout) for layout in found] for found in layouts], READ_PER_DOCUMENT
    read = [_read(trace, found) for trace, found in zip(traces, readings)]
    why = next((why for _, why in read if why), "")
    if why:
        return reference, list(ranks), f"{NOT_READ}: {why}"
    return read[0][0], [trace for trace, _ in read[1:]], done


def _layouts(trace: StepTrace) -> list[Tensor] | None:
    """The documents layout each forward of the step was fed (the model's own integer input), or None where a forward
    was fed none."""
    roots = [call for call in trace.calls if call.module == ""]
    found = [next((t for t in call.integers if packing.is_layout(t)), None) for call in roots]
    return found if found and all(layout is not None for layout in found) else None


def _read(trace: StepTrace, readings: list[Reading]) -> tuple[StepTrace, str]:
    """``trace`` with each call's records per document, or itself and why not."""
    counts = collections.Counter(call.module for call in trace.calls)
    calls = []
    for call in trace.calls:
        per_forward, rest = divmod(counts[call.module], len(readings))
        if rest or not per_forward:
            return trace, (f"`{call.module}` is called {counts[call.module]} times over {len(readings)} forwards of "
                           f"rank {trace.rank}: which forward's documents each call holds is not told")
        calls.append(_call_per_document(call, readings[call.index // per_forward]))
    return dataclasses.replace(trace, calls=calls), ""


def _call_per_document(call: ModuleCall, reading: Reading) -> ModuleCall:
    def floating(records: list[Tensor | None], gradient: bool = False) -> list[Tensor | None]:
        return [reading.read(record, gradient) for record in records]

    def integers(records: list[Tensor]) -> list[Tensor]:
        read = [reading.read(record.permute(0, 2, 1) if packing.is_layout(record) else record) for record in records]
        return [record for record in read if record is not None]

    return dataclasses.replace(call, inputs=floating(call.inputs), outputs=floating(call.outputs),
                               integers=integers(call.integers), grad_outputs=floating(call.grad_outputs, True),
                               grad_inputs=floating(call.grad_inputs, True))


def fed_apart(reference: StepTrace, ranks: Sequence[StepTrace]) -> str:
    """What differs, document by document, in the layout the candidate fed its model (traces read per document):
    its positions, document ids or token ids, or "" where its documents are not the reference's slot for slot."""
    ours = [t for call in reference.calls if call.module == "" for t in call.integers]
    theirs = [t for trace in ranks[:1] for call in trace.calls if call.module == "" for t in call.integers]
    if not ours or not theirs or ours[0].dim() != 2 or ours[0].shape[1] != len(CHANNELS):
        return ""
    fed = torch.cat([t for t in theirs if t.dim() == 2 and t.shape[1] == len(CHANNELS)])
    if fed.shape != ours[0].shape:
        return ""
    apart = [name for channel, name in CHANNELS.items() if not torch.equal(fed[:, channel], ours[0][:, channel])]
    return f"document by document, the {' and the '.join(apart)} it was fed differ" if apart else ""
