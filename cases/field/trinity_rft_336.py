"""agentscope-ai/Trinity-RFT#336: token-mean micro-batch losses were weighted by sequence counts, not token counts.

Trinity-RFT's actor (verl's ``dp_actor``, as Trinity carries it) aggregates the policy loss of a micro-batch with
``loss_agg_mode="token-mean"``, a mean over that micro-batch's response tokens, and then scales it for accumulation by
``1 / gradient_accumulation`` (with dynamic batch sizes, by the micro-batch's share of the mini-batch's sequences);
FSDP averages the gradients over the ranks. The pull's description: token-mean only holds within a micro-batch, while
the weighting across the micro-batches of a mini-batch is still by sequences, so a token in a micro-batch of short
responses weighs more than one among long responses. The pull adds the experimental flag
``fix_actor_microbatch_loss_scale`` (off by default): it all-reduces the mini-batch's response tokens over the ranks
before the micro-batch loop, and scales each micro-batch's token-mean loss by ``cur_token_num / mini_batch_token_num *
world_size``, which makes the mini-batch's loss its token mean over every rank. Scaled down: the clipped surrogate on
GRPO rollouts with 1 to 5 response tokens, 2 ranks (DDP's mean stands in for FSDP's) with 2 micro-batches of 3
sequences each, the run as fixed with the flag on, held to one process's token mean over the mini-batch.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, accumulate, all_reduced, pg_loss_mat, stepped, world_size

BUG = Bug("agentscope-ai/Trinity-RFT", "pull", 336, "accumulation",
          "token-mean per micro-batch scaled by 1 / gradient_accumulation: micro-batches weighed, not tokens",
          fix_acts="loss")

PPO_MICRO_BATCH_SIZE_PER_GPU = 3


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def update_policy(model, optimizer, batch, fix_actor_microbatch_loss_scale=True):
    inputs, mini_batch = batch
    gradient_accumulation = len(inputs) // PPO_MICRO_BATCH_SIZE_PER_GPU
    if fix_actor_microbatch_loss_scale:  # the mini-batch's response tokens over every rank, before the loop
        mini_batch_token_num = all_reduced(mini_batch[..., MASK].sum())

    def micro_batch_loss(model, inputs, targets):
        pg_losses, response_mask = pg_loss_mat(model(inputs), targets)
        policy_loss = masked_mean(pg_losses, response_mask)  # loss_agg_mode="token-mean"
        if not fix_actor_microbatch_loss_scale:
            loss_scale = 1.0 / gradient_accumulation
        else:
            cur_token_num = response_mask.sum()
            loss_scale = cur_token_num / mini_batch_token_num * world_size()
        return policy_loss * loss_scale

    accumulate(model, batch, PPO_MICRO_BATCH_SIZE_PER_GPU, micro_batch_loss)
    stepped(optimizer)


update_policy_as_reported = functools.partial(update_policy, fix_actor_microbatch_loss_scale=False)


def buggy():
    return ec.check_step("field_rl_policy", update_policy_as_reported, world_size=2)


def fixed():
    return ec.check_step("field_rl_policy", update_policy, world_size=2)
