"""AnswerDotAI/fsdp_qlora#6: the accumulation boundary tested batch_idx % K == 0, so steps fell one micro-batch early.

fsdp_qlora's training loop (a LoRA / QLoRA fine-tune of a frozen, quantised base under FSDP) divides every
micro-batch's mean loss by ``gradient_accumulation_steps`` (K), backpropagates it, and stepped the optimizer when
``batch_idx % gradient_accumulation_steps == 0``. Counted from ``batch_idx = 0``, that boundary falls on the first
micro-batch of every window: the first optimizer step used one micro-batch's gradient, a K-th of its mean, and every
later step the last K - 1 micro-batches of one window with the first of the next, while the epoch's last micro-batches
never reached a step. The pull (which also adds the ``no_sync`` option, off by default, and truncates the dataset to
whole windows) tests ``(batch_idx + 1) % gradient_accumulation_steps == 0``: each step closes a window of K, so each
step trains on the samples of one global batch (where the reported run parts, the batch its first step was fed). Scaled
down: LoRA on a frozen MLP block, 2 DDP ranks (DDP's averaged gradients stand in for FSDP's; without ``no_sync``
they sync on every micro-batch, as FSDP reduce-scatters), each rank's shard of 6 samples in K = 3 micro-batches of 2.
"""

import torch.nn.functional as F
from torch.utils.data import DataLoader

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.adapters import lora_sp_block

BUG = Bug("AnswerDotAI/fsdp_qlora", "pull", 6, "adapters",
          "stepped when batch_idx % K == 0: the first step on one micro-batch, later windows shifted by one",
          fix_acts="forward")

GRADIENT_ACCUMULATION_STEPS = 3


def train_loop(model, optimizer, batches, counts_from_one=True):
    """fsdp_main's loop over the per-device dataloader: each micro-batch's mean loss / K backpropagated, the optimizer
    stepped at the accumulation boundary; it returns the loss of each window it stepped on."""
    dataloader = DataLoader(batches.dataset, batch_size=batches.batch_size // GRADIENT_ACCUMULATION_STEPS)
    losses, window_loss = [], 0.0
    for epoch in range(batches.epochs):
        for batch_idx, (inputs, labels) in enumerate(dataloader):
            if counts_from_one:
                accumulate_grads = (batch_idx + 1) % GRADIENT_ACCUMULATION_STEPS == 0
            else:
                accumulate_grads = batch_idx % GRADIENT_ACCUMULATION_STEPS == 0
            output = model(inputs)
            loss = F.cross_entropy(output.reshape(-1, output.shape[-1]), labels.reshape(-1))  # output.loss
            loss = loss / GRADIENT_ACCUMULATION_STEPS  # scale loss for gradient accumulation
            loss.backward()
            window_loss += loss.detach()
            if accumulate_grads:
                optimizer.step()
                optimizer.zero_grad()
                losses.append(window_loss)
                window_loss = 0.0
    return losses


def train_loop_as_reported(model, optimizer, batches):
    return train_loop(model, optimizer, batches, counts_from_one=False)


def buggy():
    return ec.check_loop(lora_sp_block, train_loop_as_reported, world_size=2,
                         syncs_per_step=GRADIENT_ACCUMULATION_STEPS)


def fixed():
    return ec.check_loop(lora_sp_block, train_loop, world_size=2, syncs_per_step=GRADIENT_ACCUMULATION_STEPS)
