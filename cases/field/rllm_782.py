"""rllm-org/rllm#782: the custom loss was a token mean per forward/backward pass, and the passes' gradients summed.

After pull #781 rLLM normalises its custom losses client-side and runs Fireworks' ``optim_step`` with
``GradAccNormalization.NONE``, so the server only sums the gradients of the forward/backward calls of an optimizer
step. The loss closure ``build_custom_loss`` builds (``server_normalized=False``) sums each datum's masked per-token
loss and, for ``token-mean``, divides by the action tokens of that call alone. The fully async trainer runs
``K = mini_batch_size // fwd_bwd_group_size`` such calls per optimizer step, so the step's loss was a sum of K chunk
means, not the mean over the optimizer batch, and it changed with ``fwd_bwd_group_size``. The issue states the
invariant a fix must hold (changing ``fwd_bwd_group_size`` must not change the loss one optimizer step represents)
and asks that the client-side denominator span the complete optimizer batch; the row's fix does that: the optimizer
batch's action tokens are counted before its passes and every pass divides its raw sum by that count. Scaled down:
the clipped surrogate standing for the custom loss body, on GRPO rollouts with 1 to 5 response tokens, in one
process (the server), an optimizer step of ``mini_batch_size = 3`` task batches (groups of 4 samples) with
``fwd_bwd_group_size = 1``: 3 passes, held to one process's token mean over the optimizer batch.
"""

import functools

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, accumulate, masked_sum, pg_loss_mat, stepped

BUG = Bug("rllm-org/rllm", "issue", 782, "accumulation",
          "custom token-mean loss divided per fwd/bwd pass, passes summed (NONE): a sum of chunk means",
          fix_acts="loss")

MINI_BATCH_SIZE = 3  # task batches (groups) per optimizer step
FWD_BWD_GROUP_SIZE = 1  # task batches per forward-backward pass: K = 3 passes


def build_custom_loss(num_tokens=None):
    """The ``forward_backward_custom`` closure for ``token-mean``: each datum's masked sum, summed over the call's
    datums, over the call's own action tokens; as fixed, over ``num_tokens``, the optimizer batch's."""

    def loss_fn(model, inputs, datums):
        per_token, action_mask = pg_loss_mat(model(inputs), datums)
        total = masked_sum(per_token, action_mask)
        denominator = action_mask.sum() if num_tokens is None else num_tokens
        return total / max(denominator, 1.0)

    return loss_fn


def train_step(model, optimizer, batch, optimizer_batch_denominator=True):
    _, datums = batch
    num_tokens = datums[..., MASK].sum() if optimizer_batch_denominator else None  # before the passes
    num_fwd_bwd_passes = MINI_BATCH_SIZE // FWD_BWD_GROUP_SIZE  # the server sums their gradients (NONE)
    accumulate(model, batch, len(datums) // num_fwd_bwd_passes, build_custom_loss(num_tokens))
    stepped(optimizer)


train_step_as_reported = functools.partial(train_step, optimizer_batch_denominator=False)


def buggy():
    return ec.check_step("field_rl_policy", train_step_as_reported)


def fixed():
    return ec.check_step("field_rl_policy", train_step)
