"""deepspeedai/DeepSpeed#7837: bf16 under ZeRO stage 0 unscaled by a loss scale never applied and never zeroed grads.

With bf16 and no partitioning (ZeRO stage 0), DeepSpeed wrapped the optimizer in ``FP16_UnfusedOptimizer``, which
set up dynamic loss scaling with a current scale of 65536, while ``engine.backward()`` does not scale a bf16 loss:
``step()`` divided the true gradient by 65536. The engine's ``_take_model_step`` also cleared the gradients after the
step only under ZeRO, so under stage 0 ``.grad`` kept adding up and step t used the sum of the gradients of steps 1
to t (the growing gradient norm of the report). One process steps on step t's gradient alone, unscaled. The fix
(pull #7839) turns loss scaling off for bf16 and zeroes the gradients after every model step whatever the stage.
Scaled down to float64 (the arithmetic does not depend on bf16), the stage-0 engine over DDP.
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("deepspeedai/DeepSpeed", "issue", 7837, "zero",
          "bf16 ZeRO-0: grads divided by a loss scale never applied, and not zeroed between steps",
          fixed_by="pull #7839", fix_acts="gradient")

ZERO_STAGE = 0
INITIAL_DYNAMIC_SCALE = 2.0 ** 16
BF16 = True  # the run's precision: the engine does not scale a bf16 loss


class UnfusedOptimizer:
    """FP16_UnfusedOptimizer around the case's optimizer: unscales the gradients by its current scale, then steps."""

    def __init__(self, optimizer, dynamic_loss_scale):
        self.optimizer = optimizer
        self.cur_scale = INITIAL_DYNAMIC_SCALE if dynamic_loss_scale else 1.0

    def step(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.cur_scale)
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


def train_step(model, optimizer, batch, fixed=True):
    wrapped = UnfusedOptimizer(optimizer, dynamic_loss_scale=not BF16 if fixed else True)
    inputs, targets = batch  # this rank's 6 of mlp's 12 samples: equal shards, so DDP's average is the global mean
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()  # engine.backward: a bf16 loss is not scaled
    wrapped.step()  # _take_model_step
    if fixed or ZERO_STAGE > 0:
        wrapped.zero_grad()
    return loss.detach()


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, fixed=False)


def buggy():
    return ec.check_step("mlp", train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step("mlp", train_step, world_size=2)
