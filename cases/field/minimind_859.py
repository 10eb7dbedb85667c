"""jingyaogong/minimind#859: with top-1 routing and normalised gates the router got no gradient from the LM loss.

MiniMind's MoE defaults to one expert per token (``num_experts_per_tok=1``) with ``norm_topk_prob=True``: the top-k
gates are divided by their own sum. With one gate that sum is the gate itself, so every token's weight is exactly 1,
whatever the router says: the choice of expert is a discrete ``topk`` index and the weight a constant, so the
language-model loss has no path to the router, which learns from the aux loss alone and settles on a uniform
assignment (the issue's experts never specialised, and the MoE scored worse than a dense model a third its size).
The fix normalises only when more than one expert is chosen. Every regime trains the same dead router: an
equivalence check compares two runs of one model, and the fault is the model's, the same in each run.
"""

import dataclasses

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import MoETokens, field_moe

BUG = Bug("jingyaogong/minimind", "pull", 859, "moe",
          "top-1 routing with normalised gates: every gate is 1, the LM loss never reaches the router",
          known_miss="the fault is the model's, the same in every run: with top-1 and norm_topk_prob the gate is "
                     "g / g = 1, so the LM loss reaches no router weight in the reference either. Measured on "
                     "field_moe (top-1, LM loss only, one forward of a batch of 12): the router's LM gradient has "
                     "norm 3.9e-18 (rounding) with the normalised gate and 0.0222 without it; accumulation (3 chunks) "
                     "agrees with the full batch both ways. Catching it needs a check of the model against itself "
                     "(every parameter reached by the loss), not against another regime",
          fix_acts="forward")

top1_normalised = ec.register_case(dataclasses.replace(
    field_moe, name="field_moe_top1_normalised", model=lambda: MoETokens(k=1, normalise=True),
    description="top-1 routing, the gate divided by its own sum (MiniMind's default)"))
top1 = ec.register_case(dataclasses.replace(
    field_moe, name="field_moe_top1", model=lambda: MoETokens(k=1, normalise=False),
    description="top-1 routing, the gate the router's probability"))


def buggy():
    return ec.check("field_moe_top1_normalised", ["accumulate:chunks=3"])


def fixed():
    return ec.check("field_moe_top1", ["accumulate:chunks=3"])
