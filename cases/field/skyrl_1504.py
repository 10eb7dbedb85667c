"""NovaSky-AI/SkyRL#1504: the SFT cross-entropy summed each micro-batch, then averaged micro-batches and workers.

SkyRL's ``cross_entropy`` loss (its SFT path through ``forward_backward(loss_fn="cross_entropy")``) is a masked sum
of ``-log_probs`` over the micro-batch, Tinker's sum semantics; the policy worker backpropagated it as
``unscaled_loss * microbatch_weight`` with ``microbatch_weight = micro_batch_size / len(data)``, and FSDP averaged
the gradients over the data-parallel workers. That is a sum within a micro-batch and a mean over micro-batches and
workers, unlike the RL path since pull #1296 (a sum everywhere, times ``grad_sum_correction_factor``): with the SFT
example's loss masks of ones, the step's gradient is the global token sum times ``micro_batch_size`` over the global
batch size, so it moved with ``micro_train_batch_size_per_gpu`` (a later comment: gradients and loss depend on
``micro_batch_size``; the SFT trainer of pull #1503 compensated in its collator). The issue asks for the RL path's
sum over micro-batches and workers; pull #1893 merged it: the collator divides the loss mask by the batch's loss
tokens (``total_nonpad``, counted on the driver over the whole batch before it is split over the workers), so the
sum is the global token mean, and the worker multiplies the micro-batch's sum by ``dp_size`` instead of
``microbatch_weight``. Scaled down: the padded ``tokens`` case (1 to 7 real tokens a sequence) on 2 workers (DDP's
mean stands in for FSDP's), each worker's 6 sequences in micro-batches of 3; the driver's count is the workers'
counts all-reduced. Held to one process's token mean over the global batch.
"""

import functools

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import accumulate, all_reduced, stepped, world_size

BUG = Bug("NovaSky-AI/SkyRL", "issue", 1504, "accumulation",
          "SFT cross_entropy: micro-batch sums x micro_batch_size / len(data): the gradient moves with mbs",
          fixed_by="pull #1893", fix_acts="loss")

IGNORE = -100
MICRO_TRAIN_BATCH_SIZE_PER_GPU = 3


def cross_entropy_loss(action_log_probs, loss_mask):
    """SkyRL's ``cross_entropy_loss``: ``reduce_loss`` of ``-log_probs``, a masked sum (Tinker's SUM semantics)."""
    return (-action_log_probs * loss_mask).sum()


def forward_backward(model, optimizer, batch, sum_reduction=True):
    _, targets = batch
    total_nonpad = 1.0  # the SFT example's loss mask: 1 on every loss token
    if sum_reduction:  # pull #1893's collator: the loss mask over the batch's loss tokens (the driver's count)
        total_nonpad = all_reduced((targets != IGNORE).sum()).clamp(min=1)

    def forward_backward_micro(model, sequences, labels):
        loss_mask = (labels != IGNORE).to(float) / total_nonpad
        logits = model(sequences)
        action_log_probs = F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        policy_loss = cross_entropy_loss(action_log_probs, loss_mask)
        if sum_reduction:  # a sum over micro-batches, times dp_size against FSDP's mean over the workers
            grad_sum_correction_factor = world_size()
            return policy_loss * grad_sum_correction_factor
        microbatch_weight = MICRO_TRAIN_BATCH_SIZE_PER_GPU / len(targets)
        return policy_loss * microbatch_weight

    accumulate(model, batch, MICRO_TRAIN_BATCH_SIZE_PER_GPU, forward_backward_micro)
    stepped(optimizer)


forward_backward_as_reported = functools.partial(forward_backward, sum_reduction=False)


def buggy():
    return ec.check_step("tokens", forward_backward_as_reported, world_size=2)


def fixed():
    return ec.check_step("tokens", forward_backward, world_size=2)
