"""fla-org/flash-linear-attention#1217: packed CausalLMs shifted labels across the whole flattened row.

With ``cu_seqlens`` the library's 37 CausalLM heads shifted labels over the flattened row as for one sequence, so
each packed sequence's last token was trained to predict the next sequence's first. The pull (open; its mechanism is
plain torch, the kernels around it Triton) adds one label-preparation helper that masks the last token of each
packed sequence, and tests the loss and the parameter gradients packed against unpacked. The row: a team's step
flattens each global batch's documents into one row, as a ``cu_seqlens`` batch holds them, and shifts the labels over the flattened stream as reported, or
per document as fixed, attention kept within documents by their positions; held to the same model on the documents
padded one a row.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import packing_case, stream, token_mean_step

BUG = Bug("fla-org/flash-linear-attention", "pull", 1217, "packing",
          "labels shifted over a flattened cu_seqlens row: each sequence's last token learnt the next's first",
          fix_acts="loss")

CASE = packing_case("field_fla_1217")


def train_step_as_reported(model, optimizer, batch):
    """The documents flattened into one [1, T] row; labels shifted over it as over one sequence."""
    return token_mean_step(model, optimizer, *stream(*batch, flattened=True, label_across=True))


def train_step(model, optimizer, batch):
    """The same row, each sequence's last label masked."""
    return token_mean_step(model, optimizer, *stream(*batch, flattened=True))


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
