"""pytorch/torchtitan#1324: the aux-loss-free expert bias was updated after every micro-batch, not every step.

torchtitan's MoE balances its experts without an aux loss (DeepSeek-V3's method): the router chooses experts by
its scores plus an ``expert_bias`` buffer, the forward counts the tokens each expert was routed
(``tokens_per_expert``), and the bias moves by ``load_balance_coeff * sign(mean - count)`` (re-centred to mean 0),
the counts then zeroed. The update ran in a full backward hook of the MoE module, so under gradient accumulation it
ran once per micro-batch, from that micro-batch's counts: K updates per optimizer step where one process on the whole
batch makes one, and every micro-batch after the first was routed with a bias the whole batch never had. The pull
(which also added dp2ep expert parallelism) moved the update into an optimizer step pre-hook: counts accumulate over
the micro-batches of a step and the bias moves once, before ``optimizer.step()``. The bias is a buffer, so the
comparison sees it directly; the reference is the team's own step on the whole batch.
"""

import functools

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._moe import IGNORE

BUG = Bug("pytorch/torchtitan", "pull", 1324, "moe",
          "aux-loss-free expert bias updated in a backward hook: once per micro-batch, from its counts",
          fix_acts="state")

LOAD_BALANCE_COEFF = 1e-3
MICRO_BATCHES = 3


def update_expert_bias(moe):
    """torchtitan's ``_update_expert_bias`` (one process: no counts to all-reduce over dp_cp)."""
    with torch.no_grad():
        expert_bias_delta = LOAD_BALANCE_COEFF * torch.sign(moe.tokens_per_expert.mean() - moe.tokens_per_expert)
        expert_bias_delta = expert_bias_delta - expert_bias_delta.mean()
        moe.expert_bias.add_(expert_bias_delta)
        moe.tokens_per_expert.zero_()


def train_step(model, optimizer, batch, micro_batches=MICRO_BATCHES, in_backward_hook=False):
    tokens, labels = batch
    num_tokens = (labels != IGNORE).sum()
    for x, y in zip(tokens.chunk(micro_batches), labels.chunk(micro_batches)):
        logits, _, _ = model(x)
        lm_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        (lm_loss / num_tokens).backward()
        if in_backward_hook:  # as reported: the MoE module's full backward hook, at the end of its backward
            update_expert_bias(model)
    if not in_backward_hook:  # as fixed: the optimizer's step pre-hook
        update_expert_bias(model)
    optimizer.step()
    optimizer.zero_grad()


train_step_as_reported = functools.partial(train_step, in_backward_hook=True)
whole_batch = functools.partial(train_step, micro_batches=1)
whole_batch_as_reported = functools.partial(train_step, micro_batches=1, in_backward_hook=True)


def buggy():
    return ec.check_step("field_moe_bias", train_step_as_reported, reference=whole_batch_as_reported)


def fixed():
    return ec.check_step("field_moe_bias", train_step, reference=whole_batch)
