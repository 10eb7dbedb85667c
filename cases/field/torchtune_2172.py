"""meta-pytorch/torchtune#2172: gradients scaled by 1 / global token count, without the world size DDP divides by.

The distributed fine-tuning recipes backpropagated each rank's summed token loss, all-reduced the number of real
(not ignored) tokens over the ranks and scaled the gradients by one over that global count. The data-parallel
all-reduce also averages the ranks' gradients, dividing by the world size once more, so every gradient was 1/W of
the one a single process computes as the mean over all real tokens of the global batch (half at two GPUs: clipping
thresholds and SGD steps shifted with the number of GPUs). The fix scales the gradients by world size / token count.
"""

import torch.distributed as dist
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("meta-pytorch/torchtune", "pull", 2172, "ddp",
          "gradients scaled by 1 / global token count, missing the world size the all-reduce divides by",
          fix_acts="gradient")

IGNORE_INDEX = -100


def scale_grads(model, scaler):
    """torchtune's ``training.scale_grads``: every gradient multiplied in place."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad *= scaler


def train_step(model, optimizer, batch, world_size=dist.get_world_size):
    tokens, labels = batch
    num_tokens = (labels != IGNORE_INDEX).sum()
    logits = model(tokens)
    # the loss's per-token mean times this rank's tokens: the sum of its token losses
    current_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX) * num_tokens
    current_loss.backward()
    dist.all_reduce(num_tokens)
    scale_grads(model, world_size() / num_tokens)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, world_size=lambda: 1)


def buggy():
    return ec.check_step("tokens", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("tokens", train_step, world_size=2)
