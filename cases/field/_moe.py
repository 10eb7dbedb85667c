"""What the field's mixture-of-experts reports share: small routed models, the aux losses as their teams compute them,
the cases the rows check, and the collectives a team's own expert or tensor parallelism is built from.

Two models. ``MoETokens`` routes each token of a padded sequence to its top-k of ``EXPERTS`` small experts (every
expert runs on every token and the gate zeroes the ones not chosen: the numbers of a dispatch, at a toy's size) and
returns ``(logits, router scores, slots)``: the scores before the softmax and a one for every (token, chosen expert),
so that a team's step computes its own aux loss from them, as the teams' code does. ``RoutedVectors`` is the same
routing over vectors (a trunk below the router, a head above the experts), for expert and tensor parallelism over
ranks; its gates are the router's probabilities of the chosen experts, not normalised (OLMoE's ``norm_topk_prob``
off).

The cases declare the objective one process trains: the language-model loss over the global batch's real tokens plus
one aux term (``ec.Term``), each a mean over its own unit, so a regime that adds each shard's sum over the global
count is equivalent to the whole batch.
"""

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distributed
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck_cases.tokens import IGNORE, PAD, VOCAB, data as padded_data, real_tokens, token_losses

DIM, HIDDEN, EXPERTS, TOP_K = 8, 12, 4, 2
BALANCE_WEIGHT, Z_WEIGHT = 0.1, 0.01
FULL_LENGTH = 8  # the unpadded sequences of field_moe_full: 8 real tokens each, halved evenly by a context split


class MoETokens(nn.Module):
    """Top-k routing of tokens over ``EXPERTS`` experts. ``bias_balance``: aux-loss-free balancing (DeepSeek-V3's),
    an ``expert_bias`` buffer added to the scores that choose the experts (not to the gates), and a
    ``tokens_per_expert`` buffer counting the real tokens routed while training, accumulated over forwards until the
    team's update zeroes it (torchtitan's MoE)."""

    def __init__(self, k: int = TOP_K, normalise: bool = True, bias_balance: bool = False) -> None:
        super().__init__()
        self.k, self.normalise = k, normalise
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
                                     for _ in range(EXPERTS))
        self.head = nn.Linear(DIM, VOCAB)
        if bias_balance:
            self.register_buffer("expert_bias", torch.zeros(EXPERTS))
            self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))
        else:
            self.expert_bias = None

    def forward(self, tokens: torch.Tensor):
        hidden = self.embed(tokens)
        scores = self.router(hidden)
        probs = scores.softmax(-1)
        chosen = (probs if self.expert_bias is None else probs + self.expert_bias).topk(self.k, dim=-1).indices
        gates = probs.gather(-1, chosen)
        if self.normalise:
            gates = gates / gates.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(-1, chosen, gates)
        mixed = sum(weights[..., e : e + 1] * expert(hidden) for e, expert in enumerate(self.experts))
        slots = torch.zeros_like(probs).scatter(-1, chosen, 1.0)
        if self.expert_bias is not None and self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_((slots * (tokens != PAD)[..., None]).sum((0, 1)))
        return self.head(hidden + mixed), scores, slots


def sequence_balance(scores, slots, real):
    """The sequence-wise load-balancing loss (DeepSeek-V3's, Megatron's ``seq_aux_loss``), one value per sequence:
    ``E * sum_e f_e * P_e`` over the positions ``real`` marks (f_e: the fraction of its routed slots that chose e, a
    count with no gradient; P_e: e's mean router probability)."""
    real = real.to(scores.dtype)[..., None]
    per_sequence = real.sum(1).clamp(min=1)
    fraction = (slots * real).sum(1) / (per_sequence * slots.sum(-1).amax())  # amax: the k slots of a position
    mean_prob = (scores.softmax(-1) * real).sum(1) / per_sequence
    return EXPERTS * (fraction * mean_prob).sum(-1)


def batch_balance_per_token(scores, slots, real):
    """The batch-wise load-balancing loss (Switch's, Megatron's ``aux_loss`` over the whole batch) as one value per
    real token, ``E * sum_e f_e * p_te`` with f_e counted over every real token given: their mean is ``E * sum_e f_e *
    P_e``. Only a batch seen whole has its counts: a micro-batch's are its own."""
    real = real.reshape(-1)
    probs, slots = scores.softmax(-1).reshape(-1, EXPERTS)[real], slots.reshape(-1, EXPERTS)[real]
    fraction = slots.sum(0) / slots.sum()
    return EXPERTS * (probs * fraction).sum(-1)


def z_per_token(scores, real):
    """The router z-loss (ST-MoE's), one value per real token: ``logsumexp(scores)^2``."""
    return scores.logsumexp(-1)[real] ** 2


def lm_losses(output, targets):
    return token_losses(output[0], targets)


def full_length_data():
    """24 sequences of 8 real tokens each: no padding, so every rank and every half of a sequence holds as many."""
    tokens = torch.randint(1, VOCAB, (24, FULL_LENGTH))
    return tokens, torch.randint(1, VOCAB, (24, FULL_LENGTH))


SEQUENCE_BALANCE = ec.Term("load_balance", weight=BALANCE_WEIGHT,
                           loss=lambda output, targets: sequence_balance(output[1], output[2], targets != IGNORE))
BATCH_BALANCE = ec.Term("load_balance", weight=BALANCE_WEIGHT, units=real_tokens,
                        loss=lambda output, targets: batch_balance_per_token(output[1], output[2], targets != IGNORE))
Z_LOSS = ec.Term("router_z", weight=Z_WEIGHT, units=real_tokens,
                 loss=lambda output, targets: z_per_token(output[1], targets != IGNORE))

field_moe = ec.register_case(ec.Case(
    name="field_moe", model=MoETokens, data=padded_data, loss=lm_losses, items=real_tokens,
    terms=(SEQUENCE_BALANCE,), batch_size=12, steps=2,
    description="top-2 of 4 experts over padded sequences; LM loss over real tokens and a sequence-wise balance "
                "loss over sequences"))
field_moe_full = ec.register_case(dataclasses.replace(
    field_moe, name="field_moe_full", data=full_length_data, terms=(BATCH_BALANCE,),
    description="top-2 of 4 experts over sequences of 8 real tokens; LM loss and the batch-wise balance loss"))
field_moe_z = ec.register_case(dataclasses.replace(
    field_moe, name="field_moe_z", terms=(Z_LOSS,),
    description="top-2 of 4 experts over padded sequences; LM loss and the router z-loss, each over real tokens"))
field_moe_bias = ec.register_case(dataclasses.replace(
    field_moe, name="field_moe_bias", model=lambda: MoETokens(bias_balance=True), terms=(),
    description="top-2 of 4 experts, aux-loss-free: an expert bias buffer chooses the experts"))


# Vectors, for expert and tensor parallelism over ranks.

IN, WIDE, CLASSES = 6, 8, 3


class RoutedVectors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, IN)
        self.router = nn.Linear(IN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(IN, WIDE), nn.Tanh(), nn.Linear(WIDE, IN))
                                     for _ in range(EXPERTS))
        self.head = nn.Linear(IN, CLASSES)

    def route(self, hidden):
        """The top-2 experts of each row and their gates, the router's probabilities, not normalised."""
        chosen = F.softmax(self.router(hidden), dim=-1).topk(TOP_K, dim=-1)
        return chosen.indices, chosen.values

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        chosen, gates = self.route(hidden)
        weights = torch.zeros(len(x), EXPERTS, dtype=x.dtype).scatter(1, chosen, gates)
        mixed = sum(weights[:, e : e + 1] * expert(hidden) for e, expert in enumerate(self.experts))
        return self.head(hidden + mixed)


field_moe_vectors = ec.register_case(ec.Case(
    name="field_moe_vectors", model=RoutedVectors,
    data=lambda: (torch.randn(32, IN), torch.randint(0, CLASSES, (32,))),
    loss=lambda output, target: F.cross_entropy(output, target, reduction="none"), batch_size=16, steps=2,
    description="top-2 of 4 experts over vectors, a trunk below the router, for expert and tensor parallelism"))


# A team's parallel layers, on a mesh of one dimension: its group, and the model (for the shapes a gather needs).

GROUP = {}


def remember(model, mesh, dimension):
    GROUP["group"], GROUP["model"] = mesh[dimension].get_group(), model
    return model


def group():
    return GROUP["group"]


class CopyToParallel(torch.autograd.Function):
    """Megatron's ``copy_to_tensor_model_parallel_region``: the identity forward, the gradient summed over the group
    backward (each rank's part of the model contributed a part of it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group())
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``reduce_from_tensor_model_parallel_region``: partial outputs summed forward, the gradient as it is
    backward (every rank holds the whole output)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=group())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def experts_per_rank():
    return EXPERTS // dist.get_world_size(group())


def owner(name):
    """The rank of the group that holds expert ``experts.<e>.*``."""
    return dist.get_global_rank(group(), int(name.split(".")[1]) // experts_per_rank())


def gather_experts(name, local):
    """An expert's weight or gradient is its owner's (the expert lives on one rank of the group); the rest are
    replicated. A rank holds no gradient of an expert it does not own: its buffer is the parameter's shape."""
    if not name.startswith("experts."):
        return local
    whole = (torch.zeros_like(GROUP["model"].get_parameter(name)) if local is None else local).detach().clone()
    dist.broadcast(whole, src=owner(name), group=group())
    return whole


def exchange(rows, receiving, sending):
    """Rows to the ranks of the group by ``sending`` counts, ``receiving`` counts back: all_to_all, differentiable."""
    with warnings.catch_warnings():  # deprecated in torch 2.13; the functional one raised "invalid python storage" here
        warnings.simplefilter("ignore", FutureWarning)
        return distributed.all_to_all_single(rows.new_empty(sum(receiving), IN), rows, receiving, sending,
                                             group=group())


def expert_parallel_forward(model, x):
    """Top-2 routing; each (token, expert) slot sent to its expert's rank with all_to_all and back."""
    per_rank, rank = experts_per_rank(), dist.get_rank(group())
    hidden = torch.tanh(model.trunk(x))
    chosen, gates = model.route(hidden)
    slot_expert, slot_gate = chosen.reshape(-1), gates.reshape(-1)
    slot_token = torch.arange(len(x)).repeat_interleave(TOP_K)
    destination = slot_expert // per_rank
    order = torch.argsort(destination, stable=True)
    sending = torch.bincount(destination, minlength=dist.get_world_size(group()))
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=group())
    sending, receiving = sending.tolist(), receiving.tolist()
    arrived_expert = slot_expert.new_empty(sum(receiving))
    dist.all_to_all_single(arrived_expert, slot_expert[order].contiguous(), receiving, sending, group=group())
    arrived = exchange(hidden[slot_token[order]], receiving, sending)
    done = torch.zeros_like(arrived)
    for j in range(per_rank):
        mine = arrived_expert == rank * per_rank + j
        done = done.index_put((mine,), model.experts[rank * per_rank + j](arrived[mine]))
    back = exchange(done, sending, receiving)
    expert_out = torch.empty_like(back).index_copy(0, order, back)
    mixed = torch.zeros_like(hidden).index_add(0, slot_token, slot_gate[:, None] * expert_out)
    return model.head(hidden + mixed)
