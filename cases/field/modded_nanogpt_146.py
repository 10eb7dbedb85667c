"""KellerJordan/modded-nanogpt#146: on one GPU the accumulated gradient was the sum of 8 micro-batches, not the mean.

modded-nanogpt averages gradients over 8 GPUs (``dist.ReduceOp.AVG``); on fewer it accumulates ``grad_accum_steps = 8 //
world_size`` micro-batches, and each called ``.backward()`` on its mean loss with no ``/ grad_accum_steps``, so on one
GPU the gradient was 8 times the 8-GPU run's. The comment on the pull measured ``lm_head.weight.grad.norm()`` of 176128
against 21888 once each micro-batch's loss is divided (23040 from one backward on the whole batch). Muon orthogonalises
a momentum that is linear in the gradient and Adam divides by its root mean square, so the updates, and the loss curve,
barely move: a bug the loss cannot show. The fix divides each micro-batch's loss by ``grad_accum_steps`` before its
backward. The row trains the mlp case in one process under Muon for the weight matrices and Adam for the biases (Keller
Jordan's ``MuonWithAuxAdam``, as ``_muon`` has it), 3 micro-batches a step: it is caught at the gradient the optimizer
reads, while the final weights end within 3e-7 of the reference's (only the 1e-7 in Newton-Schulz's normalisation tells
a 3 times larger momentum apart).
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import MLP

BUG = Bug("KellerJordan/modded-nanogpt", "pull", 146, "optimizer",
          "1-GPU accumulation summed grad_accum_steps backward() calls: 8x the gradient, hidden by Muon, Adam",
          fix_acts="loss")

GRAD_ACCUM_STEPS = 3  # 8 // world_size in the speedrun; the mlp's 12 samples in 3 micro-batches of 4


def train_step(model, optimizer, batch, divides=True):
    inputs, targets = batch
    losses = []
    for x, y in zip(inputs.chunk(GRAD_ACCUM_STEPS), targets.chunk(GRAD_ACCUM_STEPS)):
        loss = F.cross_entropy(model(x), y)
        (loss / GRAD_ACCUM_STEPS if divides else loss).backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses).mean()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, divides=False)


def buggy():
    return ec.check_step(MLP, train_step_as_reported)


def fixed():
    return ec.check_step(MLP, train_step)
