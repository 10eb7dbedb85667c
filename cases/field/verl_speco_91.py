"""verl-project/verl-SpeCo#91: under FSDP1 the drafter's Muon was built over 1-D parameters only: all went to AdamW.

The pull adds an optional Muon for drafter training: one ``MuonAdamW`` optimizer whose parameters are split by
dimension, matrices (``ndim >= 2``) to Muon and the rest to AdamW. A review found that FSDP1 flattens the parameters
before the optimizer is built (``FlatParameter``, or with ``use_orig_params`` 1-D views of each rank's shard), so the
split saw nothing but 1-D tensors and routed every parameter to AdamW: ``optimizer=muon`` trained as AdamW, silently,
and the tests ran one unwrapped process only. The author confirmed it on 2-rank ``FULL_SHARD`` and made
``optimizer=muon`` refuse FSDP1 (use FSDP2 or DDP), with a multi-rank regression test; the bug was caught in review, not
shipped. The row builds the optimizer as the pull did, over FSDP1's flat shard (emulated: pure-CPU torch cannot build
FSDP1, as the pull's CI found; the mlp case's parameters flattened, padded and cut over 2 ranks, each rank's slice
stepped and all-gathered back), as reported; and over the model's own parameters on DDP, the configuration the refusal
sends a team to, as fixed.
"""

import dataclasses
import math

import torch
import torch.distributed as dist

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import adam_update, all_gather_flat, muon_update
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("verl-project/verl-SpeCo", "pull", 91, "optimizer",
          "Muon/AdamW split by ndim over FSDP1's flattened 1-D parameters: every parameter trained on AdamW",
          fixed_by="open; optimizer=muon refuses FSDP1 and the row's fix trains on DDP, as the refusal says",
          fix_acts="optimizer")

LR, MUON_LR, BETAS, EPS, WEIGHT_DECAY, MOMENTUM = 0.002, 0.02, (0.9, 0.95), 1e-8, 0.01, 0.95


class MuonAdamW(torch.optim.Optimizer):
    """The drafter's optimizer: parameters with ``ndim >= 2`` in a Muon group, the rest in an AdamW group, all state in
    ``self.state``."""

    def __init__(self, params):
        params = list(params)
        groups = [dict(params=[p for p in params if p.ndim >= 2], algorithm="muon", lr=MUON_LR),
                  dict(params=[p for p in params if p.ndim < 2], algorithm="adamw", lr=LR)]
        super().__init__([group for group in groups if group["params"]], dict(weight_decay=WEIGHT_DECAY))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["algorithm"] == "muon":
                    state.setdefault("momentum_buffer", torch.zeros_like(p))
                    update = muon_update(p.grad.clone(), state["momentum_buffer"], MOMENTUM)
                else:
                    if not state:
                        state["exp_avg"], state["exp_avg_sq"], state["step"] = \
                            torch.zeros_like(p), torch.zeros_like(p), 0
                    state["step"] += 1
                    update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], BETAS, EPS)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])


def muon_adamw(parameters):
    return MuonAdamW(parameters)


CASE = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_verl_speco_muon_adamw", optimizer=muon_adamw, regimes=("full_batch",),
    description="mlp under the drafter's MuonAdamW: Muon for the weight matrices, AdamW for the biases"))


class FlatShard(torch.optim.Optimizer):
    """FSDP1 FULL_SHARD's view of one wrapped unit: the parameters flattened in order, padded to a multiple of the
    ranks and cut, this rank's slice the one parameter the team's optimizer is built over (its gradient the slice of
    the reduced gradient); after the step the slices are all-gathered back into the parameters."""

    def __init__(self, optimizer):
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        super().__init__(self.params, {})
        self.param_groups = optimizer.param_groups  # the harness reads the case's settings, as FSDP1 leaves them
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.size = math.ceil(sum(p.numel() for p in self.params) / self.world)
        self.shard = torch.nn.Parameter(self._mine([p.detach() for p in self.params]))
        self.inner = MuonAdamW([self.shard])  # built after wrapping: over the flat shard

    def _mine(self, tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        flat = torch.cat([flat, flat.new_zeros(self.size * self.world - flat.numel())])
        return flat[self.rank * self.size:(self.rank + 1) * self.size].clone()

    @torch.no_grad()
    def step(self, closure=None):
        self.shard.grad = self._mine([p.grad for p in self.params])
        self.inner.step()
        flat, start = all_gather_flat(self.shard.detach()), 0
        for p in self.params:
            p.copy_(flat[start:start + p.numel()].view(p.shape))
            start += p.numel()


def fsdp1_flat_shard(optimizer):
    return FlatShard(optimizer)


train_step = mean_loss_step  # each rank's mean loss over its equal shard; the all-reduce averages the gradients


def buggy():
    return ec.check_step(CASE, train_step, world_size=2, optimizer_wrap=fsdp1_flat_shard)


def fixed():
    return ec.check_step(CASE, train_step, world_size=2)
