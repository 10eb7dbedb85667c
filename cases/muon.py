"""Muon, a matrix optimizer: its update orthogonalises each weight matrix's momentum (Newton-Schulz), so it reads the
whole matrix, where SGD and AdamW read each element alone.

Measured on CPU (torch 2.13, float64, the mlp case's data with bias-free layers, torch.optim.Muon at lr 0.02):
accumulation, DDP and ZeRO (which partitions whole parameters over the ranks) are equivalent to full batch. FSDP2
hands each rank's optimizer its shard of every matrix: torch's Muon orthogonalises the shard, another update than the
whole's (every gradient matches at step 0, the weights after it do not: margin 5.9e+03 in ``0.weight``).
``WholeMatrixMuon`` gathers a sharded matrix's momentum for Newton-Schulz and applies its own rows of the update, as
distributed Muon implementations do: equivalent on FSDP2 too (``muon_whole_matrix``). The same Muon reading its
learning-rate scale from the rank's shard's shape (``muon_scale_from_shard``, as Megatron's split of QKV read the local
shard's shape) steps each shard by another size. Under tensor parallelism (``tp_mlp``'s plan) the gathering Muon is
equivalent (``muon_tp_mlp``), and one that orthogonalises each rank's column or row shard, as DeepSpeed's under AutoTP
did (deepspeedai/DeepSpeed#8437), makes an update that depends on the TP degree (``muon_tp_shards``, margin 1.2e+05
in ``0.weight``).
"""

import dataclasses
import torch
from torch import nn

import equivcheck as ec

from .mlp import mlp
from .tensor_parallel import tp_mlp

LR = 0.02
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)


def bias_free():
    """mlp's 6-10-3 classifier without biases: every parameter a matrix, as Muon trains them."""
    return nn.Sequential(nn.Linear(6, 10, bias=False), nn.Tanh(), nn.Linear(10, 3, bias=False))


def orthogonalised(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``matrix``, approximately: ``steps`` Newton-Schulz iterations, as
    torch.optim.Muon computes them."""
    a, b, c = NS_COEFFICIENTS
    x = matrix / (matrix.norm() + eps)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class WholeMatrixMuon(torch.optim.Optimizer):
    """Muon on whole matrices: a parameter each rank holds a shard of (a DTensor: FSDP2's rows, a tensor-parallel
    column or row split) has its momentum gathered for Newton-Schulz, and each rank applies its own shard of the
    update; a whole parameter is stepped as it is. Otherwise torch.optim.Muon's update: momentum, Nesterov, the
    learning-rate scale of the matrix's shape (no weight decay). A parameter that is no matrix (a bias) takes the same
    momentum step unorthogonalised, as Muon's recipes hand such parameters to another optimizer. The pitfalls:
    ``from_shards``, Newton-Schulz of the rank's own shard (torch's Muon on FSDP2, DeepSpeed's under AutoTP);
    ``scale_from_shard``, the learning-rate scale read from the shard's shape."""

    def __init__(self, params, lr: float = LR, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 from_shards: bool = False, scale_from_shard: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      from_shards=from_shards, scale_from_shard=scale_from_shard))

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, distribute_tensor

        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(parameter.grad)
                momentum = state["momentum_buffer"].mul_(group["momentum"]).add_(parameter.grad)
                update = parameter.grad.add(momentum, alpha=group["momentum"]) if group["nesterov"] else momentum
                if update.ndim != 2:
                    parameter.add_(update, alpha=-group["lr"])
                    continue
                sharded = isinstance(update, DTensor)
                if sharded and group["from_shards"]:
                    local = update.to_local()
                    step = orthogonalised(local, group["ns_steps"]) * max(1.0, local.shape[0] / local.shape[1]) ** 0.5
                    parameter.to_local().add_(step, alpha=-group["lr"])
                    continue
                whole = update.full_tensor() if sharded else update
                rows, columns = (update.to_local() if sharded and group["scale_from_shard"] else whole).shape
                step = orthogonalised(whole, group["ns_steps"]) * max(1.0, rows / columns) ** 0.5
                if sharded:  # this rank's shard of the whole update: each rank computed the same whole one
                    step = distribute_tensor(step, parameter.device_mesh, parameter.placements, src_data_rank=None)
                parameter.add_(step, alpha=-group["lr"])


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for a model's hidden weight matrices, AdamW for the rest (embeddings, norms, biases), the split Muon's
    recipes make, written as a team writes it: its constructor takes the two lists apart, not param groups. Muon's
    update is torch.optim.Muon's (momentum 0.95, Nesterov, five Newton-Schulz steps, the learning rate scaled by
    sqrt(max(1, rows / columns)), decoupled weight decay), AdamW's is torch's; both keep their state in this
    optimizer's, where a check reads it."""

    def __init__(self, muon_params, adamw_params, lr: float = 0.02, adamw_lr: float = 1e-3, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        super().__init__([dict(params=list(muon_params), muon=True, lr=lr),
                          dict(params=list(adamw_params), muon=False, lr=adamw_lr)],
                         dict(momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * decay)
                if group["muon"]:
                    momentum = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    momentum.lerp_(p.grad, 1 - group["momentum"])
                    update = orthogonalised(p.grad.lerp(momentum, group["momentum"]))
                    p.add_(update, alpha=-lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)
                    continue
                (beta1, beta2), step = group["betas"], state.setdefault("step", torch.zeros(())).add_(1)
                exp_avg = state.setdefault("exp_avg", torch.zeros_like(p)).lerp_(p.grad, 1 - beta1)
                exp_avg_sq = state.setdefault("exp_avg_sq", torch.zeros_like(p)).mul_(beta2).addcmul_(
                    p.grad, p.grad, value=1 - beta2)
                denominator = (exp_avg_sq.sqrt() / (1 - beta2 ** step).sqrt()).add_(group["eps"])
                p.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))


muon_mlp = ec.register_case(dataclasses.replace(
    mlp,
    name="muon_mlp",
    model=bias_free,
    optimizer=lambda parameters: torch.optim.Muon(parameters, lr=LR),
    regimes=("full_batch", "accumulate:chunks=3", "ddp:world_size=2", "zero:world_size=2", "fsdp:world_size=2"),
    expect_mismatch={"fsdp": "torch's Muon orthogonalises each rank's shard of a matrix, not the matrix"},
    description="torch.optim.Muon on a bias-free MLP: whole matrices everywhere but FSDP2's shards",
))

muon_whole_matrix = ec.register_case(dataclasses.replace(
    muon_mlp,
    name="muon_whole_matrix",
    optimizer=lambda parameters: WholeMatrixMuon(parameters, lr=LR),
    regimes=("full_batch", "accumulate:chunks=3", "zero:world_size=2", "fsdp:world_size=2",
             "step_per_micro_batch:chunks=3"),
    expect_mismatch={"step_per_micro_batch": "Newton-Schulz once per micro-batch, its momentum advanced as often "
                                             "(DeepSpeed#8443's ZeRO-3): the orthogonalised partial gradients are "
                                             "no update of the whole one"},
    description="Muon that gathers a sharded matrix for Newton-Schulz: FSDP2 equivalent too",
))

muon_tp_mlp = ec.register_case(dataclasses.replace(
    tp_mlp,
    name="muon_tp_mlp",
    optimizer=lambda parameters: WholeMatrixMuon(parameters, lr=LR),
    regimes=("full_batch", "accumulate:chunks=3", "tp:world_size=2"),
    expect_mismatch={},
    description="tp_mlp under a Muon that gathers each tensor-parallel shard for Newton-Schulz: tp equivalent",
))

muon_tp_shards = ec.register_case(dataclasses.replace(
    muon_tp_mlp,
    name="muon_tp_shards",
    optimizer=lambda parameters: WholeMatrixMuon(parameters, lr=LR, from_shards=True),
    regimes=("full_batch", "tp:world_size=2"),
    expect_mismatch={"tp": "Newton-Schulz of each rank's column or row shard: the update depends on the TP degree"},
    description="pitfall: Muon orthogonalising each tensor-parallel shard (DeepSpeed#8437's class); twin: muon_tp_mlp",
))

muon_scale_from_shard = ec.register_case(dataclasses.replace(
    muon_whole_matrix,
    name="muon_scale_from_shard",
    optimizer=lambda parameters: WholeMatrixMuon(parameters, lr=LR, scale_from_shard=True),
    regimes=("full_batch", "fsdp:world_size=2"),
    expect_mismatch={"fsdp": "the learning-rate scale max(1, rows / columns) ** 0.5 read from the rank's shard "
                             "(5 x 6 of 10 x 6): another step size"},
    description="pitfall: Muon's learning-rate scale read from the local shard's shape; twin: muon_whole_matrix",
))
