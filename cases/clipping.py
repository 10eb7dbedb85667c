"""Gradient clipping: the training loop clips once before each optimizer step.

The mlp case with a clipping optimizer: every regime that steps once per global batch clips the whole
accumulated gradient (faithful); clipping after each micro-batch's backward clips partial sums.
MAX_NORM is below the gradient norm of every step, so clipping is active in the reference too.
"""

import dataclasses

import equivcheck as ec
from equivcheck.regimes.pitfalls import clipping_optimizer
from equivcheck.suites.catalogue import Entry, add_entry

from .mlp import mlp

MAX_NORM = 0.1

clip_per_micro_batch = ec.register_case(dataclasses.replace(
    mlp,
    name="clip_per_micro_batch",
    optimizer=clipping_optimizer(MAX_NORM),
    regimes=("full_batch", "accumulate:chunks=5", f"clip_per_micro_batch:chunks=5,max_norm={MAX_NORM}"),
    expect_mismatch={"clip_per_micro_batch": f"clipping each partial sum to {MAX_NORM} is not clipping the total once"},
    description=f"pitfall: clip_grad_norm_({MAX_NORM}) per micro-batch; the case clips once before each step",
))

# The catalogue's entries that use these cases.
add_entry(Entry("gradient clipping per micro-batch", "clip_per_micro_batch",
                f"clip_per_micro_batch:chunks=5,max_norm={MAX_NORM}"))
