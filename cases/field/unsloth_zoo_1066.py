"""unslothai/unsloth-zoo#1066: packed batches' document boundaries removed twice from num_items_in_batch.

``_unsloth_get_batch_samples`` counts the targets over ``labels[..., 1:]`` and, for a packed or padding-free batch,
subtracts one per internal document boundary (``count -= count_nonzero(seq_lengths > 0) - 1``, pull #348). The
collators packed batches come from already mask those slots (TRL's ``labels[position_ids == 0] = -100``,
transformers' ``DataCollatorWithFlattening``), so they came off twice: the count came back low and the loss and
every gradient were scaled up by ``(T - N) / (T - 2N + 1)``. The merged pull subtracts only boundaries still
labelled. The row: a team's step packs each global batch's documents into rows (each boundary already masked) and
divides the summed loss by the count as reported, or by the labelled tokens as fixed; held to the same model on the
documents padded one a row, whose mean is over their labelled tokens.
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.packing import IGNORE
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import VOCAB, packing_case, stream

BUG = Bug("unslothai/unsloth-zoo", "pull", 1066, "packing",
          "packed boundaries already masked subtracted again from num_items_in_batch: loss and grads scaled up",
          fix_acts="loss")

CASE = packing_case("field_unsloth_zoo_1066")


def num_items_in_batch(labels, position_ids, subtract_boundaries):
    count = (labels != IGNORE).sum()
    if subtract_boundaries:  # one per internal document boundary of each packed row
        count = count - sum(int((row == 0).sum()) - 1 for row in position_ids)
    return count


def packed_step(model, optimizer, batch, subtract_boundaries):
    input_ids, position_ids, labels = stream(*batch)
    logits = model(input_ids, position_ids)
    summed = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    loss = summed / num_items_in_batch(labels, position_ids, subtract_boundaries)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return packed_step(model, optimizer, batch, subtract_boundaries=True)


def train_step(model, optimizer, batch):
    return packed_step(model, optimizer, batch, subtract_boundaries=False)


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
