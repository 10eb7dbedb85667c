"""Mistakes in the accumulation loop itself, each on the mlp case next to its faithful twin (the one the
pitfall regime declares).

The uneven chunking (12 samples in 5 micro-batches: 3,3,2,2,2) also makes the sampler pitfalls bite:
padding repeats 3 samples, dropping the remainder loses 2.
"""

import dataclasses

from equivcheck import parse_regime, register_case
from equivcheck.suites.catalogue import Entry, add_entry

from .mlp import mlp


def loop_case(name, pitfall, reason, description):
    twin = str(type(parse_regime(pitfall)).pitfall.twin_of(pitfall))
    return register_case(dataclasses.replace(
        mlp, name=name, regimes=("full_batch", twin, pitfall), expect_mismatch={pitfall: reason},
        description=description,
    ))


zero_grad_inside_loop = loop_case(
    "zero_grad_inside_loop", "zero_grad_inside:chunks=5",
    "zero_grad() inside the loop throws away every micro-batch but the last",
    "pitfall: optimizer.zero_grad() inside the accumulation loop")
step_per_micro_batch = loop_case(
    "step_per_micro_batch", "step_per_micro_batch:chunks=5",
    "optimizer.step() per micro-batch takes 5 small steps instead of one",
    "pitfall: optimizer.step() after every micro-batch")
scaler_unscale_per_micro_batch = loop_case(
    "scaler_unscale_per_micro_batch", "scaler_unscale_per_micro_batch:chunks=5",
    "unscale_ per micro-batch divides the earlier partial sums by the scale again at step()",
    "pitfall: GradScaler.unscale_ per micro-batch (faithful twin: scale per micro-batch, unscale once)")
scaler_step_per_micro_batch = loop_case(
    "scaler_step_per_micro_batch", "scaler_step_per_micro_batch:chunks=5",
    "GradScaler.step per micro-batch takes 5 small steps instead of one",
    "pitfall: GradScaler.step + update after every micro-batch")
sampler_pad = loop_case(
    "sampler_pad", "sampler_pad:chunks=5",
    "padding 12 samples to 5 x 3 repeats 3 of them: they count twice",
    "pitfall: a sampler that pads by repeating samples to make micro-batches (shards) equal")
sampler_drop = loop_case(
    "sampler_drop", "sampler_drop:chunks=5",
    "dropping to 5 x 2 loses 2 of the 12 samples",
    "pitfall: a sampler that drops the remainder to make micro-batches (shards) equal")

# The catalogue's entries that use these cases.
for pitfall, case in (("zero_grad inside the accumulation loop", zero_grad_inside_loop),
                      ("optimizer.step per micro-batch", step_per_micro_batch),
                      ("GradScaler unscale_ per micro-batch", scaler_unscale_per_micro_batch),
                      ("GradScaler step per micro-batch", scaler_step_per_micro_batch),
                      ("sampler pads by repeating samples", sampler_pad),
                      ("sampler drops the remainder", sampler_drop)):
    add_entry(Entry(pitfall, case.name, case.regimes[2]))
