"""Packed sequences (issue 67): documents of 2 to 7 tokens, padded one a row for the reference, packed several a row
by the ``packed`` regime (equivcheck.packing), and the pitfalls that break the padded batch's maths.

The model is a small causal LM that reads the documents layout the way packed training does: token and position
embeddings of each slot, one self-attention block whose mask keeps every slot within its own document
(``packing.document_mask``, what ``cu_seqlens`` tells a varlen kernel), an MLP, a final norm and a head tied to the
token embedding. Its loss is each real target token's cross-entropy, the mean over the global batch's tokens. Packed
faithfully (``packed``, with or without micro-batches of rows, and under ``accumulate``, ``ddp`` and ``fsdp`` on
the padded rows) every gradient is the padded batch's; each pitfall is caught, and located where its bug acts
(tests/test_packing.py): an attention that drops the document mask (``packed_documents_causal_only``, right on
padded rows alone) in ``attention``; the packer's positions running on in the batch the model is fed; a label across
the boundary and a per-row mean at ``loss``.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.packing import POSITIONS, TOKENS, document_mask, padded
from equivcheck.suites.catalogue import Entry, add_entry

from .tokens import real_tokens, token_losses  # each real target token's cross-entropy; their count

VOCAB, DIM, HEADS, LENGTH = 16, 8, 2, 6  # LENGTH: the slots of a row, padded or packed
DOCUMENTS_IN_ALL, BATCH_SIZE = 24, 12


class DocumentAttention(nn.Module):
    """Causal self-attention within each slot's document: the mask the layout's document ids make. Without
    ``within_documents``, causal over the whole row: right on padded rows (a document's tokens come first, its
    padding after them, which causality hides), wrong on packed ones (a 2-D mask's path that dropped the packed
    positions' mask: huggingface/transformers#46634)."""

    def __init__(self, within_documents: bool = True) -> None:
        super().__init__()
        self.within_documents = within_documents
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x, layout):
        rows, slots, _ = x.shape
        q, k, v = (part.view(rows, slots, HEADS, DIM // HEADS).transpose(1, 2) for part in self.qkv(x).chunk(3, -1))
        if self.within_documents:
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(layout)[:, None])
        else:
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(rows, slots, DIM))


class DocumentLM(nn.Module):
    def __init__(self, within_documents: bool = True) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(LENGTH, DIM)
        self.attention = DocumentAttention(within_documents)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, layout):
        x = self.tokens(layout[:, TOKENS]) + self.positions(layout[:, POSITIONS])
        x = x + self.attention(x, layout)
        x = x + self.mlp(x)
        return self.norm(x) @ self.tokens.weight.T  # the head tied to the token embedding


def documents():
    """24 documents of 2 to 7 tokens (1 to 6 inputs each), padded one a row."""
    lengths = torch.randint(2, LENGTH + 2, (DOCUMENTS_IN_ALL,))
    return padded([torch.randint(1, VOCAB, (int(n),)) for n in lengths], LENGTH)


def causal_only():
    return DocumentLM(within_documents=False)


PITFALLS = {
    "packed_positions_run_on": "positions counted over the packed row: a later document's tokens embed other positions",
    "packed_label_across": "each document's last input learns the next document's first token, not its own next one",
    "packed_row_mean": "each packed row's mean over its own tokens, averaged over rows: rows hold unequal tokens",
}

packed_documents = ec.register_case(ec.Case(
    name="packed_documents",
    model=DocumentLM,
    data=documents,
    loss=token_losses,
    items=real_tokens,
    batch_size=BATCH_SIZE,
    steps=2,
    # the matrix's share; tests/test_packing.py runs every packed regime, accumulate and ddp besides
    regimes=("full_batch", "packed:chunks=2", *PITFALLS),
    expect_mismatch=PITFALLS,
    description="24 documents of 1 to 6 input tokens, padded one a row for the reference and packed several a row "
                "(positions, document ids and targets kept per document) by the packed regimes",
))

packed_documents_causal_only = ec.register_case(dataclasses.replace(
    packed_documents,
    name="packed_documents_causal_only",
    model=causal_only,
    regimes=("full_batch", "packed"),
    expect_mismatch={"packed": "the attention's mask is causal over the row, not within each document: packed, a "
                               "document attends to the earlier ones of its row"},
    description="negative control: the model's attention drops the document mask, right on padded rows only",
))

for name, reason in PITFALLS.items():
    add_entry(Entry(f"packing: {reason.split(':')[0]}", "packed_documents", name))
add_entry(Entry("packing: the attention's document mask dropped", "packed_documents_causal_only", "packed",
                twin="packed", twin_case="packed_documents"))
