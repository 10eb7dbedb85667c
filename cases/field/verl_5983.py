"""verl-project/verl#5983: under context parallelism the token-mean's batch_num_tokens was summed over pure DP only.

verl's Megatron engine normalises ``loss_agg_mode="token-mean"`` by ``batch_num_tokens``, the global batch's
response tokens: ``forward_backward_batch`` sums ``loss_mask`` on each rank and all-reduces it over
``self.get_data_parallel_group()``, the pure data-parallel group. With ``context_parallel_size > 1`` each CP rank
holds only a ``1 / CP`` slice of every sequence, so that sum counts one slice's tokens: the denominator is CP times
too small where the slices hold as many tokens, and each rank's is its own slice's where they do not. Megatron-Core
multiplies the loss by the CP size and averages the gradients over the DP x CP group, which is right only for the
global count, so the step was about CP times too large. The issue asks for the all-reduce over
``mpu.get_data_parallel_group(with_context_parallel=True)`` (pulls #5993 and #6049 made that change and were closed
unmerged), ``dp_size`` kept pure DP; that is the fixed code here. Scaled down: the GRPO rollouts' clipped surrogate on
a per-token policy (every token's logits depend on that token alone, so CP's attention exchange is left out), CP = 2
and DP = 1, each rank taking its half of every sequence, DDP averaging over the DP x CP group.
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import MASK, all_reduced, pg_loss_mat, stepped

BUG = Bug("verl-project/verl", "issue", 5983, "accumulation",
          "CP > 1: the token-mean's batch_num_tokens all-reduced over pure DP, CP times too few tokens",
          fix_acts="loss")

GROUPS = {}


def parallelize(model, mesh):
    """Megatron's DDP: gradients averaged over the DP x CP group (here every rank)."""
    GROUPS["dp"], GROUPS["cp"] = mesh["dp"].get_group(), mesh["cp"].get_group()
    return DistributedDataParallel(model)


def forward_backward_batch(model, optimizer, batch, with_context_parallel=True):
    inputs, targets = batch
    cp_size, cp_rank = dist.get_world_size(GROUPS["cp"]), dist.get_rank(GROUPS["cp"])
    inputs, targets = inputs.chunk(cp_size, dim=1)[cp_rank], targets.chunk(cp_size, dim=1)[cp_rank]
    dp_size = dist.get_world_size(GROUPS["dp"])  # pure DP, as the issue keeps it
    batch_num_tokens = targets[..., MASK].sum().double()
    dist.all_reduce(batch_num_tokens, group=None if with_context_parallel else GROUPS["dp"])
    pg_losses, response_mask = pg_loss_mat(model(inputs), targets)
    loss = (pg_losses * response_mask).sum() / batch_num_tokens * dp_size  # agg_loss, token-mean
    (loss * cp_size).backward()  # Megatron-Core's forward_step: output_tensor *= cp_group_size
    stepped(optimizer)
    return all_reduced(loss.detach()) / dp_size  # the global token mean, for the report


def forward_backward_batch_as_reported(model, optimizer, batch):
    return forward_backward_batch(model, optimizer, batch, with_context_parallel=False)


def buggy():
    return ec.check_step("field_rl_policy", forward_backward_batch_as_reported, mesh={"cp": 2},
                         parallelize=parallelize)


def fixed():
    return ec.check_step("field_rl_policy", forward_backward_batch, mesh={"cp": 2}, parallelize=parallelize)
