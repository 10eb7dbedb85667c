"""pytorch/pytorch#190758: under activation_memory_budget < 1, compiled dropout was recomputed with a fresh mask.

With ``torch._functorch.config.activation_memory_budget`` below 1.0, AOTAutograd's min-cut partitioner may choose to
recompute a random op (dropout, ``randn_like``) in the backward graph instead of saving its output, and the
recomputed op draws fresh randomness there: the backward applies another dropout mask than the forward used, and the
gradients are silently wrong, with no error or warning. The report traces two paths to it: at budget 0 the
partitioner returns before its ban on recomputing random ops runs, and at 0 < budget < 1 the knapsack can trade the
banned ops back into recompute (the fix's pull reproduced it at 0.005 and 0.5); it reproduces on CPU and does not
depend on ``graphsafe_rng_functionalization``. It extends #190717 (the budget 0 case). Torch's fixes (pulls #190759
and #191684) were open when this row was written, and the installed torch 2.13 reproduces it (measured on a 6-10-3
MLP with one dropout layer: equal forwards, gradients off by up to 4.4); a team on 2.13 leaves the budget at its
default 1.0 for a model with dropout, the run as fixed here. The team's step compiles dropout_one_layer with the
partitioner the budget steers (the ``aot_eager_decomp_partition`` backend, inductor's partitioner without its code
generation) at budget 0.5, and gates it against eager full batch with ``torch._inductor.config.fallback_random =
True``, so the compiled forward draws eager's masks (measured: forwards equal at every budget).
"""

import weakref

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 190758, "compile",
          "activation_memory_budget < 1: partitioner recomputed dropout in backward with a fresh mask",
          fixed_by="pulls #190759, #191684 (open); on torch 2.13, the budget left at 1.0", fix_acts="compiler")

REPORTED_BUDGET = 0.5

COMPILED = weakref.WeakKeyDictionary()  # each run's compiled model, by its optimizer


def step_with(model, optimizer, batch, budget=1.0):
    if optimizer not in COMPILED:
        torch._dynamo.reset()
        COMPILED[optimizer] = torch.compile(model, backend="aot_eager_decomp_partition")
    inputs, targets = batch
    with torch._functorch.config.patch(activation_memory_budget=budget), \
            torch._inductor.config.patch(fallback_random=True):
        loss = F.cross_entropy(COMPILED[optimizer](inputs), targets)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step(model, optimizer, batch):
    """As fixed on torch 2.13: the default budget, every activation the partitioner wants saved is saved."""
    return step_with(model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    return step_with(model, optimizer, batch, budget=REPORTED_BUDGET)


def buggy():
    return ec.check_step("dropout_one_layer", train_step_as_reported)


def fixed():
    return ec.check_step("dropout_one_layer", train_step)
