"""pytorch/torchtitan#4167: validation averaged per-batch token means with equal weights, not the global token mean.

torchtitan's validator divided each validation batch's summed loss by that batch's valid-token count (over the
data-parallel ranks) and then averaged those per-batch means equally over the validation steps: a mean of batch
means, in which a batch with few valid tokens (short responses, prompts masked with the ignore index, a short last
batch) weighs as much as a full one. The pull's own example: batches with (loss sum, valid tokens) (2, 1) and
(90, 9) gave 6.0 where the token-weighted loss is 9.2. The logged value also depended on how the validation set was
cut into batches, so the same model on another number of ranks logged another loss. The fix accumulates the raw
loss sums and the valid-token counts and normalises once after the loop, after reducing the loss sum over the loss
mesh. Here the team's validation of the padded ``tokens`` model (1 to 7 real tokens per sequence, batches of 4
sequences per rank) runs on 2 ranks and in one process.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/torchtitan", "pull", 4167, "evaluation",
          "validation loss: per-batch token means averaged equally over steps, not the global token mean",
          fix_acts="metric")

IGNORE = -100
LOCAL_BATCH_SIZE = 4


def my_batches(dataset):
    """This rank's shard (every W-th sequence from its rank), in batches of 4."""
    if dist.is_initialized():
        dataset = Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))
    return DataLoader(dataset, batch_size=LOCAL_BATCH_SIZE)


def batch_loss_sums(model, dataset):
    """Each step's summed token loss on this rank and its valid tokens over the ranks."""
    for inputs, labels in my_batches(dataset):
        predictions = model(inputs)
        loss_sum = F.cross_entropy(predictions.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        global_valid_tokens = (labels != IGNORE).sum().double()
        if dist.is_initialized():
            dist.all_reduce(global_valid_tokens)
        yield loss_sum.detach(), global_valid_tokens


def validate_as_reported(model, dataset):
    accumulated_losses = [loss_sum / global_valid_tokens for loss_sum, global_valid_tokens in
                          batch_loss_sums(model, dataset)]
    loss = torch.stack(accumulated_losses).mean()
    if dist.is_initialized():  # the ranks' shares of each step's mean, summed over the loss mesh
        dist.all_reduce(loss)
    return {"validation_loss": loss}


def validate(model, dataset):
    loss_sums, token_counts = zip(*batch_loss_sums(model, dataset))
    total_loss, total_tokens = torch.stack(loss_sums).sum(), torch.stack(token_counts).sum()
    if dist.is_initialized():
        dist.all_reduce(total_loss)
    return {"validation_loss": total_loss / total_tokens}


def buggy():
    return ec.check_eval("tokens", validate_as_reported)


def fixed():
    return ec.check_eval("tokens", validate)
