"""unslothai/unsloth-zoo#348: packed batches counted their document boundaries in num_items_in_batch.

Unsloth's sample packing (unsloth pull #3525, then #3566, which this pull accompanies) flattens TRL's padding-free
batch into one row and masks each packed document's last prediction in the loss (``mask_packed_sequence_boundaries``),
but ``_unsloth_get_batch_samples`` still counted the targets as ``labels[..., 1:] != -100``, and the collators of the
time labelled every token, the boundaries included: the count was high by one per internal boundary, and the loss and
every gradient were scaled down by ``(T - N) / (T - 1)`` for N documents of T tokens. The pull subtracts
``count_nonzero(seq_lengths > 0) - 1``. A review notes that over several rows this removes ``batch_size - 1`` too
many (``labels[..., 1:]`` already drops one a row); the flattened batch here is one row, where it is exact. Where a
collator masks the boundaries itself, the same subtraction removes them twice (pull #1066, its own row). The row: a
team's step flattens each global batch's documents into one row fed to a model that reads the documents layout,
sums the loss over the documents' own targets and divides by the count as reported or as the pull corrects it; held
to the same model on the documents padded one a row.
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.packing import DOCUMENTS, IGNORE, PADDING, pack
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import VOCAB, layout_case, stream

BUG = Bug("unslothai/unsloth-zoo", "pull", 348, "packing",
          "packed boundaries the loss masks counted in num_items_in_batch: loss and grads scaled down",
          fix_acts="loss")

CASE = layout_case("field_unsloth_zoo_348")


def num_items_in_batch(batch, correct_packed_lengths):
    """``_unsloth_get_batch_samples``' count over the collator's labels: the flattened documents, every token
    labelled (TRL's padding-free collator before it masked ``position_ids == 0``)."""
    input_ids, position_ids, _ = stream(*batch, flattened=True)
    labels = input_ids.clone()
    count = (labels[..., 1:] != IGNORE).sum()
    if correct_packed_lengths:  # the pull: N packed sequences have N - 1 internal boundaries
        starts = torch.nonzero(position_ids.reshape(-1) == 0).reshape(-1).tolist()
        seq_lengths = torch.tensor(starts[1:] + [position_ids.numel()]) - torch.tensor(starts)
        count = count - (torch.count_nonzero(seq_lengths > 0).item() - 1)
    return count


def packed_step(model, optimizer, batch, correct_packed_lengths):
    layout, targets = batch
    row, labels = pack(layout, targets, length=int((layout[:, DOCUMENTS] != PADDING).sum()))  # one flattened row
    logits = model(row)  # each document's last prediction masked: its targets are its own tokens
    summed = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    loss = summed / num_items_in_batch(batch, correct_packed_lengths)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return packed_step(model, optimizer, batch, correct_packed_lengths=False)


def train_step(model, optimizer, batch):
    return packed_step(model, optimizer, batch, correct_packed_lengths=True)


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
