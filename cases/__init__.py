"""equivcheck's built-in cases: each module registers its cases when imported."""

from . import batchnorm, cnn, gru_decoder, mlp, seed000_embedding_head, seed004_linear, tokens  # noqa: F401
