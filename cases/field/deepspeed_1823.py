"""deepspeedai/DeepSpeed#1823: ZeRO-3 stepped FusedAdam once per sub-group, and its step count was the group's.

ZeRO stage 3 keeps its fp32 partition in sub-groups (``sub_group_size``) and runs the optimizer on one sub-group at a
time: ``_optimizer_step`` puts that sub-group's flat tensor in the param group, calls ``optimizer.step()`` and empties
the group again. DeepSpeed's ``FusedAdam`` kept one step count per param group (``group['step'] += 1`` on every call,
"assume same step across group now to simplify things"), so within one training step the first sub-group was
stepped with bias correction for step 1, the second for step 2, and so on: every sub-group after the first took a
smaller Adam update than one process's, and the gap stayed as the counts ran ahead. The fix keeps the count per tensor
(``state['step']``, seeded from the group's for old checkpoints) and increments it once per step of that tensor. Here
the team's ZeRO-3 stepping is cut down to its sub-group loop around a torch-native FusedAdam (the kernel's
arithmetic) on 2 DDP ranks; block_stack's parameters fall into sub-groups of at most 120 elements.
"""

import dataclasses

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("deepspeedai/DeepSpeed", "pull", 1823, "zero",
          "ZeRO-3 stepped FusedAdam per sub-group on one group['step']: later sub-groups' bias correction ahead",
          fix_acts="optimizer")

LR, SUB_GROUP_SIZE = 0.01, 120

ADAM = ec.register_case(dataclasses.replace(
    ec.get_case("block_stack"), name="field_block_stack_adam",
    optimizer=lambda params: torch.optim.Adam(params, lr=LR), regimes=("full_batch",),
    description="block_stack trained with Adam (bias correction from each tensor's own step count)"))


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam, the multi-tensor kernel's arithmetic written in torch: as reported the bias correction
    uses the group's step, counted per ``step()`` call; as fixed, each tensor's own count."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, per_tensor_step=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.per_tensor_step = per_tensor_step

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            if self.per_tensor_step:
                group.setdefault("step", 0)
            else:
                group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = group.get("step", 0) if self.per_tensor_step else 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                if self.per_tensor_step:
                    state["step"] += 1
                step = state["step"] if self.per_tensor_step else group["step"]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


class Stage3Optimizer(torch.optim.Optimizer):
    """The part of ZeRO-3 at stake: the parameters cut into sub-groups in order, each stepped on its own."""

    def __init__(self, params, per_tensor_step):
        params = list(params)
        super().__init__(params, {})
        self.optimizer = FusedAdam([{"params": []}], lr=LR, per_tensor_step=per_tensor_step)
        self.sub_groups, size = [[]], 0
        for p in params:
            if size and size + p.numel() > SUB_GROUP_SIZE:
                self.sub_groups.append([])
                size = 0
            self.sub_groups[-1].append(p)
            size += p.numel()

    def _optimizer_step(self, sub_group_id):
        self.optimizer.param_groups[0]["params"] = self.sub_groups[sub_group_id]
        self.optimizer.step()
        self.optimizer.param_groups[0]["params"] = []

    @torch.no_grad()
    def step(self, closure=None):
        for sub_group_id in range(len(self.sub_groups)):
            self._optimizer_step(sub_group_id)


def zero3(optimizer):
    """As fixed: FusedAdam counts each tensor's steps."""
    return Stage3Optimizer(optimizer.param_groups[0]["params"], per_tensor_step=True)


def zero3_as_reported(optimizer):
    return Stage3Optimizer(optimizer.param_groups[0]["params"], per_tensor_step=False)


train_step = mean_loss_step  # each rank's mean loss over its equal shard; DDP averages the gradients.


def buggy():
    return ec.check_step(ADAM, train_step, world_size=2, optimizer_wrap=zero3_as_reported)


def fixed():
    return ec.check_step(ADAM, train_step, world_size=2, optimizer_wrap=zero3)
