"""deepspeedai/DeepSpeed#8443: ZeRO-3 ran Muon's Newton-Schulz once per micro-batch, not once per optimizer step.

ZeRO-3 applied Muon inside its gradient reduce: ``__avg_scatter_contiguous_grads`` calls
``_apply_distributed_muon_update`` on every backward's averaged bucket, and the reduce runs once per micro-batch. With
``gradient_accumulation_steps: n`` the momentum advanced n times per step, Newton-Schulz orthogonalised each
micro-batch's share of the gradient, and the partitions summed n orthogonalised updates where one process orthogonalises
the accumulated gradient once. The issue counted 16 Newton-Schulz calls where 4 were due (two matrices, two steps,
gas=4) and measured the weights of gas=1 and gas=4 on the same samples 1.0e-1 apart under ZeRO-3 (3.3e-4 under ZeRO-2).
Pull #8600 takes Muon out of the reduce, so the partitions accumulate the raw averaged gradient, and runs it in
``step()`` (``_apply_muon_to_accumulated_grads``: each matrix's gradient all-gathered, ``muon_update`` on it, the local
slice kept). Here the mlp case trains under DeepSpeed's ``MuonWithAuxAdam`` on 2 DDP ranks, ZeRO-3's chunked partitions
written in plain PyTorch around it (``_muon.Stage3``), each rank's 6 samples in 3 micro-batches, each reduced; the
gradient the harness reads is the partitions as the reduces left them, gathered: as reported they hold the summed
updates, so the run parts at the gradient the optimizer steps on, where the fix puts the raw gradient back.
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import MLP, Stage3

BUG = Bug("deepspeedai/DeepSpeed", "issue", 8443, "optimizer",
          "ZeRO-3 ran Muon in each micro-batch's reduce: n momentum steps, n orthogonalised partial gradients",
          fixed_by="pull #8600", fix_acts="gradient")

GRADIENT_ACCUMULATION_STEPS = 3  # each rank's 6 samples of the mlp's 12: micro-batches of 2


def zero3(optimizer):
    """The team's ZeRO-3 optimizer around the case's MuonWithAuxAdam, as fixed: Muon once, in step()."""
    return Stage3(optimizer, muon_in_reduce=False)


def zero3_as_reported(optimizer):
    return Stage3(optimizer, muon_in_reduce=True)


def train_step(model, optimizer, batch):
    inputs, targets = batch
    losses = []
    chunks = zip(inputs.chunk(GRADIENT_ACCUMULATION_STEPS), targets.chunk(GRADIENT_ACCUMULATION_STEPS))
    for micro_step_id, (x, y) in enumerate(chunks):
        loss = F.cross_entropy(model(x), y)
        (loss / GRADIENT_ACCUMULATION_STEPS).backward()  # engine.backward scales by the accumulation steps
        optimizer.reduce_partition(micro_step_id)
        losses.append(loss.detach())
    optimizer.full_grads()
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean()


def buggy():
    return ec.check_step(MLP, train_step, world_size=2, optimizer_wrap=zero3_as_reported,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)


def fixed():
    return ec.check_step(MLP, train_step, world_size=2, optimizer_wrap=zero3,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)
