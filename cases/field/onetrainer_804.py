"""Nerogar/OneTrainer#804: bf16 stochastic rounding drew unseeded noise on each rank, so data-parallel replicas drifted.

OneTrainer writes an optimizer's update into bfloat16 weights with ``copy_stochastic_``: a random 16-bit integer added
to the low half of each float32 result's bits, which are then masked off, so the weight is rounded up or down with
the probability of its distance. The integers came from ``torch.randint`` with no generator, that is from each
process's global random stream, which differs from rank to rank (each draws its own training noise), so replicas
that all-reduced identical gradients rounded them differently and trained apart, and no run could be repeated. Pull
#804 (merged) gives the rounding a generator of its own, and its review adds that the seed must follow the step,
or resuming still draws other noise: OneTrainer re-seeds it with the global step before every step
(``set_seed(global_step, device)``); Koratahiu/Advanced_Optimizers#7 reports the same unseeded draw. Here the mlp
case trains by AdamW whose weights live on bfloat16's grid (the update computed in the case's float64, rounded to
float32, then stochastically to bfloat16 by OneTrainer's bit arithmetic) on 2 DDP ranks, each rank's global stream
seeded with the seed plus its rank. As reported the ranks round with their own noise and part from the one process
and from each other by bfloat16 ulps after the first step; as fixed the generator is seeded with the optimizer's
step count, every rank draws the one process's noise, and the runs agree exactly.
"""

import dataclasses

import torch
import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("Nerogar/OneTrainer", "pull", 804, "precision",
          "bf16 stochastic rounding drew unseeded per-rank noise: DP replicas with equal grads drifted apart",
          fix_acts="optimizer")


def copy_stochastic_(target, source, generator=None):
    """OneTrainer's ``copy_stochastic_``: ``source`` as float32, a random 16-bit integer added to its bits' low half,
    the low half masked off, the bfloat16 value that is left copied into ``target``."""
    source = source.to(torch.float32)
    result = torch.randint(size=source.shape, device=source.device, dtype=torch.int32, low=0, high=1 << 16,
                           generator=generator)
    result.add_(source.view(dtype=torch.int32))
    result.bitwise_and_(-65536)  # FFFF0000
    target.copy_(result.view(dtype=torch.float32))


class StochasticRoundingAdamW(torch.optim.AdamW):
    """AdamW whose weights are bfloat16 in the team's code: the update computed as AdamW computes it, then each
    weight rounded stochastically to bfloat16. ``seeded``: the noise from a generator of the optimizer's own,
    re-seeded with the step's number before each step (pull #804 with its review); else from the process's global
    random stream, as before it."""

    def __init__(self, params, seeded=True, **options):
        super().__init__(params, **options)
        self.seeded, self.steps = seeded, 0
        self.generator = torch.Generator() if seeded else None

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        if self.seeded:
            self.generator.manual_seed(self.steps)  # OneTrainer: set_seed(global_step, device) before the step
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    copy_stochastic_(p, p, self.generator)


def sr_adamw(parameters):
    return StochasticRoundingAdamW(parameters, lr=1e-2)


def sr_adamw_as_reported(parameters):
    return StochasticRoundingAdamW(parameters, seeded=False, lr=1e-2)


MLP = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_onetrainer_sr", optimizer=sr_adamw,
    description="mlp under AdamW with bf16 weights, stochastically rounded from a step-seeded generator"))
MLP_AS_REPORTED = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_onetrainer_sr_as_reported", optimizer=sr_adamw_as_reported,
    description="mlp under AdamW with bf16 weights, stochastically rounded from the global random stream"))


def rank_seeded_step():
    """The team's process on each rank: its global random stream seeded with the seed plus its rank (each rank
    draws its own training noise), then the plain step."""
    torch.manual_seed(torch.initial_seed() + dist.get_rank())
    return mean_loss_step


def buggy():
    return ec.check_step(MLP_AS_REPORTED, rank_seeded_step, world_size=2, per_run=True)


def fixed():
    return ec.check_step(MLP, rank_seeded_step, world_size=2, per_run=True)
