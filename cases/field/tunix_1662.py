"""google/tunix#1662: under packing, aggregate_loss averaged each pack row as if it were one sequence.

With sequence packing tunix's per-token loss is ``[num_packs, T]``, each row holding several sequences told apart by
``segment_ids``, but ``aggregate_loss`` only reads ``completion_mask``, so its sequence-mean modes (the default
``sequence-mean-token-mean`` among them) took each pack row's token mean as one sequence's and averaged the packs:
only ``token-mean`` was the same packed and unpacked. The pull (open) adds ``make_unpack_indices`` and
``aggregate_loss_packed``, which scatter the packed tensor back to ``[n_max, T]``, one row a sequence, by a
``segment_ids`` scatter and run the original ``aggregate_loss`` on it, counting only the non-empty rows. Tunix is JAX;
this row ports the two functions, for the default mode, to torch in a few lines. The row: a team's step packs each
global batch's documents into rows, the model reading the documents layout, takes each slot's cross-entropy as the
per-token loss and aggregates it per pack row as reported or per sequence as fixed; held to the same model on the
documents padded one a row, each a sequence, whose objective is the mean over documents of their token means.
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.packing import DOCUMENTS, IGNORE, PADDING, POSITIONS, pack
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import VOCAB, layout_case

BUG = Bug("google/tunix", "pull", 1662, "packing",
          "per_token_loss [num_packs, T] aggregated per pack row: every sequence-mean mode averaged the packs",
          fix_acts="loss")

PACKED_LENGTH = 16  # the slots of a pack row: 2 to 6 sequences each


def per_token_loss(logits, targets):
    """Each slot's cross-entropy (0 where no target), and the completion mask."""
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE, reduction="none")
    return losses.reshape(targets.shape), (targets != IGNORE).to(logits.dtype)


def aggregate_loss(per_token_loss, completion_mask):
    """tunix's ``aggregate_loss`` for ``sequence-mean-token-mean``, a row taken as a sequence (ported to torch)."""
    seq_mask = completion_mask.sum(-1)  # per-sequence token count
    seq_loss = (per_token_loss * completion_mask).sum(-1) / seq_mask.clamp(min=1.0)
    return seq_loss.sum() / (seq_mask > 0).sum().clamp(min=1)


def make_unpack_indices(segment_ids):
    """For every slot of a pack row, the row of its sequence in the unpacked ``[n_max, T]`` (segment 0: padding)."""
    before = torch.cat([segment_ids.new_zeros(1), segment_ids.amax(-1).cumsum(0)[:-1]])  # sequences in earlier packs
    return before[:, None] + segment_ids - 1


def aggregate_loss_packed(per_token_loss, completion_mask, segment_ids, n_max):
    """The pull: scatter ``[num_packs, T]`` back to ``[n_max, T]``, row = sequence, then ``aggregate_loss``."""
    real = segment_ids > 0
    rows, columns = make_unpack_indices(segment_ids)[real], torch.nonzero(real)[:, 1]
    unpacked_loss = per_token_loss.new_zeros(n_max, per_token_loss.shape[-1]).index_put((rows, columns),
                                                                                          per_token_loss[real])
    unpacked_mask = completion_mask.new_zeros(n_max, completion_mask.shape[-1]).index_put((rows, columns),
                                                                                          completion_mask[real])
    return aggregate_loss(unpacked_loss, unpacked_mask)


def sequence_means(logits, targets):
    """The objective: each padded row's (one sequence's) token mean, one item a sequence."""
    losses, mask = per_token_loss(logits, targets)
    return (losses * mask).sum(-1) / mask.sum(-1)


CASE = layout_case("field_tunix_1662", loss=sequence_means, items=len,  # one item a padded row
                   description="packed_documents' documents under DocumentLM, the mean over documents of each "
                               "document's token mean (sequence-mean-token-mean)")


def packed_step(model, optimizer, batch, unpacked):
    layout, targets = batch
    packs, pack_targets = pack(layout, targets, PACKED_LENGTH)
    # pack_sequences' segment_ids: the sequences of each pack row numbered from 1, 0 on padding
    real = packs[:, DOCUMENTS] != PADDING
    segment_ids = torch.where(real, ((packs[:, POSITIONS] == 0) & real).cumsum(-1), 0)
    losses, completion_mask = per_token_loss(model(packs), pack_targets)
    if unpacked:
        loss = aggregate_loss_packed(losses, completion_mask, segment_ids, n_max=len(layout))
    else:
        loss = aggregate_loss(losses, completion_mask)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return packed_step(model, optimizer, batch, unpacked=False)


def train_step(model, optimizer, batch):
    return packed_step(model, optimizer, batch, unpacked=True)


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
