"""NVIDIA/Megatron-LM#5976: Megatron FSDP's state-materializing step advanced Adam's step count before training.

``fully_shard_optimizer()`` materialized the optimizer's lazy state for DCP checkpoint loading the way PyTorch DCP's
``_init_optim_state`` does: a zero gradient on every parameter, one ``optimizer.step()``, ``zero_grad()``. A zero
gradient does not make that step inert. Adam and AdamW advance their step counters whatever the gradient, so a fresh
run's first real update used the bias correction of step 2 (about 1.34x too small an update, the pull says, as issue
#5974 reported); with the learning rate left on, decoupled weight decay moved the weights, and coupled decay filled
the moments whatever the learning rate. The fix sets the learning rate and the weight decay to zero for that step,
restores them after it and resets every per-group and per-parameter step counter to zero, so the first real update
is step 1's. Here 2 ranks shard block_stack with FSDP2 (each block, then the root) and the team's optimizer wrap is
``fully_shard_optimizer``'s state initialization around the case's Adam, whose weight decay is 0: only the step
count is left for the synthetic step to change.
"""

import dataclasses

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import fully_sharded, mean_loss_step

BUG = Bug("NVIDIA/Megatron-LM", "pull", 5976, "fsdp",
          "fully_shard_optimizer's zero-grad state-init step advanced Adam's step: first update under-sized",
          fix_acts="state")

ADAM = ec.register_case(dataclasses.replace(
    ec.get_case("block_stack"), name="field_block_stack_fsdp_adam",
    optimizer=lambda params: torch.optim.Adam(params, lr=0.01), regimes=("full_batch",),
    description="block_stack trained with Adam, its state materialized before training by a synthetic step"))


def fully_shard_optimizer(optimizer, inert=True):
    """Megatron FSDP's pre-initialization of the optimizer state: a synthetic zero-gradient step. As fixed, its
    learning rate and weight decay are zeroed for that step and restored, and the step counters reset after it."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    settings = [(group, {key: group[key] for key in ("lr", "weight_decay") if key in group})
                for group in optimizer.param_groups]
    if inert:
        for group, _ in settings:
            group.update({key: 0.0 for key in ("lr", "weight_decay") if key in group})
    optimizer.step()
    for group, saved in settings:
        group.update(saved)
    if inert:
        for state in (*optimizer.param_groups, *optimizer.state.values()):
            if "step" in state:
                if isinstance(state["step"], torch.Tensor):
                    state["step"].zero_()
                else:
                    state["step"] = 0
    optimizer.zero_grad()
    return optimizer


def fully_shard_optimizer_as_reported(optimizer):
    return fully_shard_optimizer(optimizer, inert=False)


train_step = mean_loss_step  # each rank's mean loss over its equal shard; FSDP2 averages the gradients.


def buggy():
    return ec.check_step(ADAM, train_step, world_size=2, wrap=fully_sharded,
                         optimizer_wrap=fully_shard_optimizer_as_reported)


def fixed():
    return ec.check_step(ADAM, train_step, world_size=2, wrap=fully_sharded, optimizer_wrap=fully_shard_optimizer)
