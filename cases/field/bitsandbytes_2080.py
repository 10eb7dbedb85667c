"""bitsandbytes-foundation/bitsandbytes#2080: under FSDP1, AdamW8bit's size threshold saw the flat shard, not the parameters.

bitsandbytes keeps a tensor's Adam moments in 8 bits only where ``p.numel()`` reaches ``min_8bit_size`` (4,096), and
smaller tensors keep 32-bit moments. FSDP1 with ``use_orig_params=False`` hands the optimizer one flattened shard
per wrap unit, the unit's parameters concatenated and split over the ranks, so the threshold measures the shard:
several small parameters wrapped together reach it as one flat shard and their moments switch to 8 bits, while
wrapped one by one (or trained in one process) they stay in full precision. The report, on 2 CPU/gloo ranks, found
the updates of identical models and gradients changed with the wrap policy alone (its draft pull #2081 measures
6.15e-5 between the two policies' updates after two steps). The issue is open; #2081 keeps the state with the
original parameters instead: each one's
gradient and value gathered from the flat shards, its own AdamW8bit state (8-bit by its own size) stepped, and
this rank's slice copied back into the flat shard. Here FSDP1's flat shards are written out in plain PyTorch around
the blockwise 8-bit AdamW of ``equivcheck_cases.eight_bit`` (bitsandbytes' rule, its weight decay after the update), on 2 DDP
ranks whose averaged gradient is what FSDP1's reduce-scatter leaves each rank: a 128-64 projection (an 8,192-element
weight, 8-bit everywhere) in its own unit and a block of two small linear layers (4,032, 63, 4,032 and 64 elements,
each below the threshold) wrapped together, whose 8,191-element flat parameter leaves 4,096 on each rank. As
reported the block's moments are quantised and its updates part from the one process's full-precision ones from the
second step; with the state on the original parameters they agree.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.eight_bit import AdamW8bit, adamw_update, eight_bit_eligible, new_moment
from equivcheck_cases.field._references import mean_loss_step

BUG = Bug("bitsandbytes-foundation/bitsandbytes", "issue", 2080, "precision",
          "FSDP1 flat shard crossed AdamW8bit's 4096-element threshold: small params got 8-bit state",
          fixed_by="open; state kept per original parameter, gathered from the flat shards (draft pull #2081)",
          fix_acts="optimizer 2")

FEATURES, WIDTH, INNER, CLASSES = 128, 64, 63, 3
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)  # bitsandbytes' AdamW8bit defaults


def model():
    """The projection (0), the block of two small layers (2), the head (4): FSDP1's units by the wrap policy."""
    block = nn.Sequential(nn.Linear(WIDTH, INNER), nn.Tanh(), nn.Linear(INNER, WIDTH))
    return nn.Sequential(nn.Linear(FEATURES, WIDTH, bias=False), nn.Tanh(), block, nn.Tanh(),
                         nn.Linear(WIDTH, CLASSES))


def data():
    return torch.randn(36, FEATURES), torch.randint(0, CLASSES, (36,))


# The wrap policy's units as ranges of model.parameters(): the projection, the block, and the root's own (the head).
UNITS = ((0, 1), (1, 5), (5, 7))


def bnb_adamw8bit(parameters):
    """bitsandbytes' AdamW8bit in one process: each parameter's own size decides its state."""
    return AdamW8bit(parameters, **ADAMW, size_of="local", whole_blocks=False, decay_after=True)


class FlatShardAdamW8bit(torch.optim.Optimizer):
    """FSDP1 ``FULL_SHARD`` with ``use_orig_params=False`` under bitsandbytes' AdamW8bit, in plain PyTorch: each wrap
    unit's parameters flattened into one flat parameter, padded to a multiple of the world size, this rank holding a
    contiguous shard of it and stepping that shard with its slice of the averaged flat gradient; after the step the
    shards are gathered and the original parameters are views of the whole again (FSDP1's unshard).
    ``original_parameter_state``: pull #2081's reference, each original parameter's gradient and value gathered and
    stepped with its own state, this rank's slice copied back into its flat shard; else bitsandbytes as it is, one
    state per flat shard, 8-bit where the shard reaches the threshold."""

    def __init__(self, parameters, original_parameter_state):
        parameters = list(parameters)
        super().__init__(parameters, dict(ADAMW))
        self.original_parameter_state = original_parameter_state
        self.units = [parameters[start:end] for start, end in UNITS]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shards = [self.shard_of([p.detach() for p in unit]) for unit in self.units]

    def shard_of(self, tensors):
        """This rank's shard of the flat concatenation of ``tensors``, zero-padded to a multiple of the world size."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        size = math.ceil(flat.numel() / self.world)
        flat = F.pad(flat, (0, size * self.world - flat.numel()))
        return flat[self.rank * size:(self.rank + 1) * size].clone()

    def gather(self, shard, unit):
        """The whole flat tensor from every rank's shard, cut into ``unit``'s original parameters' shapes."""
        pieces = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(pieces, shard)
        flat = torch.cat(pieces)
        sizes = [p.numel() for p in unit]
        return [t.view(p.shape) for t, p in zip(flat[:sum(sizes)].split(sizes), unit)]

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                     decay_after=True)
        for unit, shard in zip(self.units, self.shards):
            grad_shard = self.shard_of([p.grad for p in unit])  # what FSDP1's reduce-scatter leaves this rank
            if self.original_parameter_state:
                values = self.gather(shard, unit)
                for p, value, grad in zip(unit, values, self.gather(grad_shard, unit)):
                    state = self.moments(p, value)
                    state["step"] += 1
                    adamw_update(value, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], **hyper)
                shard.copy_(self.shard_of(values))
            else:
                state = self.moments(unit[0], shard)  # one state for the flat shard, sized by it
                state["step"] += 1
                adamw_update(shard, grad_shard, state["exp_avg"], state["exp_avg_sq"], state["step"], **hyper)
            for p, whole in zip(unit, self.gather(shard, unit)):
                p.copy_(whole)

    def moments(self, key, like):
        state = self.state[key]
        if not state:
            eight_bit = eight_bit_eligible(like.numel(), whole_blocks=False)
            state.update(step=0, exp_avg=new_moment(like, True, eight_bit), exp_avg_sq=new_moment(like, False, eight_bit))
        return state


def flat_shards(optimizer):
    """As reported: bitsandbytes steps each unit's flat shard with one state."""
    return FlatShardAdamW8bit(optimizer.param_groups[0]["params"], original_parameter_state=False)


def original_parameter_state(optimizer):
    """As fixed (pull #2081's reference): the state kept per original parameter."""
    return FlatShardAdamW8bit(optimizer.param_groups[0]["params"], original_parameter_state=True)


CLASSIFIER = ec.register_case(ec.Case(
    name="field_bnb_flat_shards", model=model, data=data,
    loss=lambda logits, y: F.cross_entropy(logits, y, reduction="none"), batch_size=12, steps=3,
    optimizer=bnb_adamw8bit,
    description="128-64 projection, a block of two small tanh layers, a 3-class head, under bitsandbytes' AdamW8bit"))


def buggy():
    return ec.check_step(CLASSIFIER, mean_loss_step, world_size=2, optimizer_wrap=flat_shards)


def fixed():
    return ec.check_step(CLASSIFIER, mean_loss_step, world_size=2, optimizer_wrap=original_parameter_state)
