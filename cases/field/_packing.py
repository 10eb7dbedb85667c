"""What the packing family's rows share: documents (the built-in ``packed_documents``' draws, ``cases/packing.py``),
a small causal LM written as Hugging Face models read a packed batch, and a team's step that packs each global
batch's documents into one stream of rows.

The model takes token ids, ``position_ids`` and a 2-D ``attention_mask``, and decides its attention mask as
transformers' masking code does: documents are found where ``position_ids`` restart at 0 (``find_packed_sequence_
indices``), and a block-diagonal causal mask is used where they are; otherwise the causal mask alone, with the 2-D
mask's padding (trailing, so causality hides it); a 4-D mask is used as given. Without ``position_ids`` it embeds
each slot's index in its row. ``gate_on_mask``: packing detected only where no ``attention_mask``
is passed (huggingface/transformers pull #46634's report). The reference is the same model on the padded documents,
one a row, fed their padding mask.

``layout_case``: the rows whose bug is in the loss instead feed cases/packing.py's ``DocumentLM`` the documents
layout itself (``equivcheck.packing.pack``'s rows, each slot's token, position and document id), so that a caught run
is read per document and its first difference found at the loss, not in the batch fed.
"""

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.packing import DOCUMENTS, IGNORE, PADDING, POSITIONS, TOKENS
from equivcheck_cases.packing import (BATCH_SIZE, DIM, HEADS, LENGTH, VOCAB, DocumentLM, documents, real_tokens,
                                     token_losses)


def packed_sequence_mask(position_ids):
    """``(rows, slots, slots)``: causal within each run of positions that starts at 0 (a document)."""
    starts = (position_ids == 0).long().cumsum(-1)
    slots = position_ids.shape[-1]
    causal = torch.ones(slots, slots, dtype=torch.bool, device=position_ids.device).tril()
    return (starts[:, :, None] == starts[:, None, :]) & causal


class PackedLM(nn.Module):
    def __init__(self, gate_on_mask: bool = False) -> None:
        super().__init__()
        self.gate_on_mask = gate_on_mask
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(LENGTH + 1, DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def attention(self, x, position_ids, attention_mask):
        rows, slots, _ = x.shape
        q, k, v = (part.view(rows, slots, HEADS, DIM // HEADS).transpose(1, 2) for part in self.qkv(x).chunk(3, -1))
        packed = position_ids is not None and not (self.gate_on_mask and attention_mask is not None)
        if attention_mask is not None and attention_mask.dim() == 4:  # a 4-D mask is used as given
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.bool())
        elif packed:  # `_preprocess_mask_arguments`: packing detected from the position ids
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_sequence_mask(position_ids)[:, None])
        else:  # the `is_causal` path: trailing padding is hidden by causality alone
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(rows, slots, DIM))

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        positions = position_ids if position_ids is not None else torch.arange(
            input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)  # the default: the row's slots
        x = self.tokens(input_ids) + self.positions(positions)
        x = x + self.attention(x, position_ids, attention_mask)
        return self.norm(x) @ self.tokens.weight.T


def padded_forward(model, layout, targets):
    """The reference: each document alone in its row, fed its padding mask as a padded batch is."""
    return model(layout[:, TOKENS], layout[:, POSITIONS], (layout[:, DOCUMENTS] != PADDING).long())


def packing_case(name: str, gate_on_mask: bool = False) -> ec.Case:
    return ec.Case(name=name, model=lambda: PackedLM(gate_on_mask), data=documents, loss=token_losses,
                   items=real_tokens, forward=padded_forward, batch_size=BATCH_SIZE, steps=2,
                   description="packed_documents' documents under a model that reads position_ids and a 2-D mask "
                               "as Hugging Face models do (cases/field/_packing.py)")


def layout_case(name: str, loss=token_losses, items=real_tokens, description: str = "") -> ec.Case:
    """packed_documents' documents under ``DocumentLM``, which reads the documents layout: a team's step feeds it the
    layout packed (``equivcheck.packing.pack``), the reference the documents padded one a row. ``loss`` and
    ``items``: the objective (default: each real target token's cross-entropy, the mean over the global batch's)."""
    return ec.Case(name=name, model=DocumentLM, data=documents, loss=loss, items=items, batch_size=BATCH_SIZE,
                   steps=2, description=description or "packed_documents' documents under DocumentLM, which reads "
                                                       "the documents layout (cases/field/_packing.py)")


def stream(layout, targets, *, label_across=False, flattened=False):
    """The global batch's documents packed into rows of LENGTH + 1 slots (next fit: a document that does not fit
    starts the next row; ``flattened``: all in one row, as a varlen ``cu_seqlens`` batch of shape [1, T] holds
    them), as a packing collator concatenates them: each document whole (its inputs and its last
    token), each token labelled with the next one of its document, a document's last token with IGNORE (or,
    ``label_across``, with the next document's first token: labels shifted over the stream); ``position_ids``
    restarting at each document."""
    pieces = []
    for row in range(len(layout)):
        real = layout[row, DOCUMENTS] != PADDING
        pieces.append(torch.cat([layout[row, TOKENS][real], targets[row][real][-1:]]))
    width = sum(len(piece) for piece in pieces) if flattened else LENGTH + 1
    rows, free = [[]], width
    for index, document in enumerate(pieces):
        if len(document) > free:
            rows.append([])
            free = width
        last = IGNORE if not label_across or index + 1 == len(pieces) else int(pieces[index + 1][0])
        rows[-1].append((document, torch.arange(len(document)), torch.cat([document[1:], torch.tensor([last])])))
        free -= len(document)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for row, held in enumerate(rows):
        slot = 0
        for tokens, positions, document_labels in held:
            end = slot + len(tokens)
            input_ids[row, slot:end], position_ids[row, slot:end], labels[row, slot:end] = \
                tokens, positions, document_labels
            slot = end
    return input_ids, position_ids, labels


def token_mean_step(model, optimizer, input_ids, position_ids, labels, attention_mask=None):
    """One optimizer step on the mean of every labelled token's cross-entropy."""
    logits = model(input_ids, position_ids, attention_mask)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()
