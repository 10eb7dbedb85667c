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

# Clipping on shards (issue 66): FSDP2's and HSDP's own clip counts each logical element once (clip_grad_norm_ over
# DTensors, regime option max_norm=); the pitfalls are the norms teams computed otherwise, each against the reference
# that clips the whole gradient once (full_batch:max_norm=...). MAX_NORM is below the gradient norm at every step.
clip_on_shards = ec.register_case(dataclasses.replace(
    mlp,
    name="clip_on_shards",
    regimes=("full_batch", "fsdp:world_size=2", "hsdp:replicate=2,shard=1"),
    expect_mismatch={"fsdp_clip_averaged": "a mean of the ranks' partial norms is below the whole gradient's norm",
                     "hsdp_clip_over_replicas": "each replica's squares summed again: the norm sqrt(R) times too large"},
    description="the mlp under FSDP2 and HSDP, for the catalogue's norms on shards (clipped at max_norm=0.1 there)",
))
CLIPPED_REFERENCE = f"full_batch:max_norm={MAX_NORM}"
add_entry(Entry("clipping by a norm averaged over the ranks (FSDP2)", "clip_on_shards",
                f"fsdp_clip_averaged:world_size=2,max_norm={MAX_NORM}", reference=CLIPPED_REFERENCE))
add_entry(Entry("clipping by a norm that counts each replica's elements again (HSDP)", "clip_on_shards",
                f"hsdp_clip_over_replicas:replicate=2,shard=1,max_norm={MAX_NORM}", reference=CLIPPED_REFERENCE))
