"""equivcheck's built-in cases: each module registers its cases when imported."""

from . import (  # noqa: F401
    batchnorm, cnn, ddp_traps, gru_decoder, mlp, seed000_embedding_head, seed003_article, seed004_linear, tokens,
)
