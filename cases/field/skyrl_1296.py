"""NovaSky-AI/SkyRL#1296: token_mean was a mean of micro-batch token means, averaged again over the workers.

SkyRL's ``token_mean`` loss reduction took ``masked_mean(loss, loss_mask)`` inside each micro-batch; the policy worker
backpropagated it unscaled, ``optim_step`` multiplied the gradients by ``1 / micro_batches_accumulated``, and FSDP's
all-reduce averaged them over the data-parallel workers. With micro-batches and workers holding different numbers of
response tokens that is a mean of means: pull #925's example has 100 tokens at 0.5 and 900 at 0.3 giving 0.4 where the
token mean is 0.32, and a micro-batch of one sequence makes it a sequence mean. Pull #1296 makes ``reduce_loss`` a
masked sum and moves the normalisation into the advantages: the trainer divides each mini-batch's advantages by its
response-token count, the worker multiplies the loss by ``dp_size`` before ``backward()`` to turn the workers' mean
into a sum, and ``optim_step`` no longer scales by the micro-batch count (the old behaviour stays as
``token_mean_legacy``). Scaled down: the PPO surrogate on GRPO rollouts with 1 to 5 response tokens, 2 workers (DDP's
mean stands in for FSDP's), 2 micro-batches of 3 each; the trainer's count over the whole mini-batch is the workers'
counts all-reduced. Held to one process's token mean over the mini-batch.
"""



import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import ADVANTAGE, MASK, accumulate, all_reduced, pg_loss_mat, stepped, world_size

BUG = Bug("NovaSky-AI/SkyRL", "pull", 1296, "accumulation",
          "token_mean: masked_mean per micro-batch, grads / micro-batches, mean over workers: a mean of means",
          fix_acts="loss")

MICRO_BATCH_SIZE = 3  # micro_train_batch_size_per_gpu


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum().clamp(min=1)


def train_step_as_reported(model, optimizer, batch):
    """``token_mean`` before the pull: a token mean per micro-batch, the gradients scaled by 1 / micro-batches."""
    def policy_loss(model, inputs, targets):
        return masked_mean(*pg_loss_mat(model(inputs), targets))

    accumulate(model, batch, MICRO_BATCH_SIZE, policy_loss)
    micro_batches_accumulated = -(-len(batch[0]) // MICRO_BATCH_SIZE)
    for parameter in model.parameters():  # optim_step: scale accumulated gradients by 1/N
        parameter.grad.mul_(1.0 / micro_batches_accumulated)
    stepped(optimizer)


def apply_loss_reduction_to_advantages_minibatch(targets):
    """The trainer's normalisation for ``token_mean``: the advantages over the mini-batch's response tokens."""
    normalized = targets.clone()
    normalized[..., ADVANTAGE] = targets[..., ADVANTAGE] / all_reduced(targets[..., MASK].sum()).clamp(min=1)
    return normalized


def train_step(model, optimizer, batch):
    """As fixed: pre-scaled advantages, a masked sum per micro-batch, times dp_size against the workers' mean."""
    inputs, targets = batch
    batch = inputs, apply_loss_reduction_to_advantages_minibatch(targets)
    grad_sum_correction_factor = world_size()

    def policy_loss(model, inputs, targets):
        loss_mat, loss_mask = pg_loss_mat(model(inputs), targets)
        return (loss_mat * loss_mask).sum() * grad_sum_correction_factor

    accumulate(model, batch, MICRO_BATCH_SIZE, policy_loss)
    stepped(optimizer)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", train_step, world_size=2)
