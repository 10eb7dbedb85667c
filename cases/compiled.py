"""torch.compile as a wrap (equivcheck.regimes.compiled): the same regimes with their module compiled by inductor,
judged against the eager reference at the precision's own tolerance.

Measured on CPU (torch 2.13, float64): accumulation and DDP compiled by inductor are equivalent to full batch, and the
micro-batch mean / K pitfall under compile is caught as it is eager (margin 8e+04).
"""

import dataclasses

import equivcheck as ec

from .tokens import tokens

compiled_tokens = ec.register_case(dataclasses.replace(
    tokens,
    name="compiled_tokens",
    regimes=("full_batch", "accumulate:chunks=2,compile=inductor", "ddp:world_size=2,compile=inductor",
             "naive_accumulate:chunks=4,compile=inductor"),
    expect_mismatch={"naive_accumulate": "compiled or not, equal chunks of 3 samples hold unequal numbers of real "
                                         "tokens"},
    description="the tokens case with its regimes compiled by inductor, against the eager reference",
))
