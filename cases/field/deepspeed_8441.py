"""deepspeedai/DeepSpeed#8441: at ZeRO stage 0, the default, DeepSpeed's Muon ran no Newton-Schulz and trained as SGD.

DeepSpeed moved Muon's update out of ``MuonWithAuxAdam.step`` into the ZeRO optimizers, which orthogonalise each matrix
while they fill the flat partition; the step itself only did ``p.add_(p.grad.reshape(p.shape), alpha=-lr)`` for the Muon
group, taking the gradient as an update already made. With no ZeRO optimizer (``zero_optimization.stage`` defaults to 0)
nothing had made it: the raw gradient was applied, no momentum and no orthogonalisation, and the report measured the
weights within 1.5e-8 of plain SGD's with zero Newton-Schulz calls, no error and a falling loss. Pull #8442 makes the
step tell the two apart by shape: a flat partition keeps the ZeRO path, a parameter that is still a matrix gets
``muon_update`` (momentum, Nesterov, Newton-Schulz, the shape's scale) in the step. The row trains the mlp case on 2 DDP
ranks, as DeepSpeed's engine all-reduces gradients at stage 0, with the engine's ``MuonWithAuxAdam`` (Muon for the two
weight matrices, Adam for the biases) built from the case's param groups.
"""

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import MLP, MuonWithAuxAdam
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("deepspeedai/DeepSpeed", "issue", 8441, "optimizer",
          "Muon at ZeRO stage 0 applied the raw gradient as if ZeRO had orthogonalised it: Muon trained as SGD",
          fixed_by="pull #8442", fix_acts="optimizer")


def stage_0(optimizer):
    """The engine's optimizer at stage 0: MuonWithAuxAdam itself, over the case's groups, as fixed."""
    return MuonWithAuxAdam([dict(group) for group in optimizer.param_groups])


def stage_0_as_reported(optimizer):
    return MuonWithAuxAdam([dict(group) for group in optimizer.param_groups], runs_muon=False)


train_step = mean_loss_step  # each rank's mean loss over its equal shard; the all-reduce averages the gradients


def buggy():
    return ec.check_step(MLP, train_step, world_size=2, optimizer_wrap=stage_0_as_reported)


def fixed():
    return ec.check_step(MLP, train_step, world_size=2, optimizer_wrap=stage_0)
