"""equivcheck's built-in cases: each module registers its cases when imported."""

from . import (  # noqa: F401
    accumulation_loops, adapters, batchnorm, block_stack, clipping, cnn, compiled, ddp_hooks, ddp_traps, dropout, eight_bit, experts, gru_decoder, mlp,
    muon, packing, resume, rl, seed000_embedding_head, seed003_article, seed004_linear, sequence_parallel, tensor_parallel, tokens,
)
