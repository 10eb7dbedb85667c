"""equivcheck's built-in cases: each module registers its cases when imported."""

from . import (  # noqa: F401
    accumulation_loops, batchnorm, clipping, cnn, dropout, gru_decoder, mlp, seed000_embedding_head, seed004_linear,
    tokens,
)
