"""Routed experts with an objective of several terms (ec.Term), each normalised over its own unit: the language-model
loss over real tokens, a sequence-wise load-balancing loss over sequences, a router z-loss over real tokens.

A padded token model routes each real token to its top-k of E small experts (a shared expert beside them), the gate
weights the router's probabilities of the chosen experts (normalised over them where ``normalise``). Its output is
``(logits, load_balance, z)``: one balance value per sequence, ``E * sum_e f_e * P_e`` over the sequence's real tokens
(f_e: the fraction of its routed slots that chose e; P_e: e's mean router probability), and one z value per real
token, ``logsumexp(router logits)^2``. Each is a mean of per-unit values, so every regime that adds each micro-batch's
sums over the global batch's counts gives the full batch's gradient: accumulation, one sample at a time, DDP and FSDP2
are equivalent. Written as one scalar loss weighted by tokens, the balance term would not be: that is the false alarm
a single per-item loss gave (a sequence's balance value counted once per token).

The model declares its experts (``experts`` and ``mix``), so expert parallelism (``ep:world_size=W``) spreads them
over ranks and exchanges tokens by ``all_to_all_single``. Measured on CPU, float64: the faithful family is equivalent
under ``accumulate``, ``sample_by_sample``, ``ddp``, ``fsdp``, ``ep`` (2 and 4 ranks) and ``fsdp_ep`` (dp 2 x ep 2), and so is the aux-loss-free bias moved at each
optimizer step; a balance over the whole batch is declared non-equivalent under a cut; each pitfall below is caught
(tests/test_experts.py, the catalogue).
"""

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

from .tokens import IGNORE, PAD, VOCAB, data, real_tokens, token_losses

DIM, EXPERTS, HIDDEN = 8, 4, 12
BALANCE_WEIGHT, Z_WEIGHT = 0.1, 0.01


class RoutedTokens(nn.Module):
    """Top-k routing over ``EXPERTS`` experts and a shared one; every expert runs on every token and the gate zeroes
    the ones not chosen (the same numbers as a dispatch, at a toy's size).

    ``bias_rate`` above 0: aux-loss-free balancing (DeepSeek-V3's): an expert bias, a buffer added to the scores for the
    choice only, moved by ``bias_rate`` towards the balanced load after each optimizer step (:meth:`update_bias`, from
    the tokens routed since the last, summed over the ranks where there are). ``update_in_backward``: moved after each
    backward instead, as a hook on the output's gradient: per micro-batch under accumulation."""

    def __init__(self, k: int = 2, normalise: bool = True, shared: bool = True, experts: int = EXPERTS,
                 bias_rate: float = 0.0, update_in_backward: bool = False) -> None:
        super().__init__()
        self.k, self.normalise, self.bias_rate, self.update_in_backward = k, normalise, bias_rate, update_in_backward
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("routed", torch.zeros(experts))  # tokens routed to each expert since the last update
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
                                     for _ in range(experts))
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM)) if shared else None
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor):
        hidden = self.embed(tokens)
        scores = self.router(hidden)  # (samples, tokens, experts)
        probs = scores.softmax(-1)
        chosen = (probs + self.expert_bias).topk(self.k, dim=-1) if self.bias_rate else probs.topk(self.k, dim=-1)
        picked = probs.gather(-1, chosen.indices)  # the bias chooses; the gates are the router's own probabilities
        gates = picked / picked.sum(-1, keepdim=True) if self.normalise else picked
        weights = torch.zeros_like(probs).scatter(-1, chosen.indices, gates)
        mixed = self.mix(hidden, weights)
        if self.shared is not None:
            mixed = mixed + self.shared(hidden)
        real = (tokens != PAD).to(probs.dtype)
        slots = torch.zeros_like(probs).scatter(-1, chosen.indices, 1.0) * real[..., None]
        per_sequence = real.sum(1).clamp(min=1)[:, None]
        fraction = slots.sum(1) / (per_sequence * self.k)  # f_e per sequence, counts: no gradient
        mean_prob = (probs * real[..., None]).sum(1) / per_sequence  # P_e per sequence
        balance = len(self.experts) * (fraction * mean_prob).sum(-1)
        z = scores.logsumexp(-1)[tokens != PAD] ** 2
        everywhere = real.sum().clamp(min=1)
        batch_balance = len(self.experts) * (slots.sum((0, 1)) / (everywhere * self.k)
                                             * (probs * real[..., None]).sum((0, 1)) / everywhere).sum()
        logits = self.head(hidden + mixed)
        if self.bias_rate and self.training:
            with torch.no_grad():
                self.routed += slots.sum((0, 1))
            if self.update_in_backward and logits.requires_grad:
                logits.register_hook(lambda grad: self.update_bias() or grad)
        return logits, balance, z, batch_balance

    def update_bias(self) -> None:
        """The expert bias moved towards the balanced load by the tokens routed since the last update (over every
        rank), which then start again from 0."""
        with torch.no_grad():
            if dist.is_initialized():
                dist.all_reduce(self.routed)
            self.expert_bias += self.bias_rate * torch.sign(self.routed.mean() - self.routed)
            self.routed.zero_()

    def mix(self, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' outputs weighted by the gates (0 where not chosen): what expert parallelism dispatches."""
        return sum(weights[..., e : e + 1] * expert(hidden) for e, expert in enumerate(self.experts))


def lm_losses(output, targets):
    return token_losses(output[0], targets)


def real_token_count(targets) -> int:
    return int((targets != IGNORE).sum())


BALANCE = ec.Term("load_balance", loss=lambda output, targets: output[1], weight=BALANCE_WEIGHT)
# The balance over the whole batch's tokens: one value per batch, whose expert counts a micro-batch cannot see
BATCH_BALANCE = ec.Term("batch_balance", loss=lambda output, targets: output[3].reshape(1), units=lambda targets: 1,
                        weight=BALANCE_WEIGHT)
Z_LOSS = ec.Term("router_z", loss=lambda output, targets: output[2], units=real_token_count, weight=Z_WEIGHT)



def routed_case(name: str, *, experts: int = EXPERTS, k: int = 2, normalise: bool = True, shared: bool = True,
                balance: float = BALANCE_WEIGHT, z: float = Z_WEIGHT, batch_size: int = 12,
                dtype: torch.dtype = torch.float64, balance_over: str = "sequence", bias_rate: float = 0.0,
                update_in_backward: bool = False, **more) -> ec.Case:
    """A routed-experts case over the 24 padded sequences: ``experts`` experts, top-``k``, the gates ``normalise``d
    or not, a ``shared`` expert or none, the balance (over each ``sequence``, or the whole ``batch``) and z terms at
    their weights (0: left out), an aux-loss-free bias moved at ``bias_rate`` (see :class:`RoutedTokens`). Drawn
    configurations (bench/bench_false_alarms.py --experts) are made here, as the built-in cases are."""
    balanced = BALANCE if balance_over == "sequence" else BATCH_BALANCE
    terms = tuple(dataclasses.replace(term, weight=weight) for term, weight in ((balanced, balance), (Z_LOSS, z))
                  if weight)
    model = functools.partial(RoutedTokens, k, normalise, shared, experts, bias_rate, update_in_backward)
    if bias_rate and not update_in_backward:
        more.setdefault("optimizer", updating_bias)
    return ec.Case(name=name, model=model, data=data,
                   loss=lm_losses, items=real_tokens, terms=terms, batch_size=batch_size, steps=24 // batch_size,
                   dtype=dtype, **more)


def updating_bias(parameters):
    """The case's default optimizer, the model's expert bias moved after each of its steps (the faithful place)."""
    optimizer = ec.default_optimizer(parameters)
    optimizer.register_step_post_hook(lambda *_: parameters.model.update_bias())
    return optimizer


routed_tokens = ec.register_case(routed_case(
    "routed_tokens",
    regimes=("full_batch", "accumulate:chunks=3", "sample_by_sample", "ddp:world_size=2",
             "ddp_no_sync:world_size=2,chunks=2", "fsdp:world_size=2", "ep:world_size=2",
             "ddp_aux_over_world:world_size=2", "ddp_aux_times_world:world_size=2", "ep_experts_averaged:world_size=2",
             "fsdp_ep:dp=2,ep=2", "fsdp_ep_experts_over_dp:dp=2,ep=2"),
    expect_mismatch={
        "ep_experts_averaged": "each expert's gradient averaged over the 2 expert-parallel ranks: half of it",
        "fsdp_ep_experts_over_dp": "each expert's gradient averaged over its 2 replicas only: twice it",
        "ddp_aux_over_world": "the aux terms averaged by DDP without the world size: aux / dp_size",
        "ddp_aux_times_world": "the aux terms scaled by the world size twice",
    },
    description="top-2 of 4 experts and a shared one; LM loss over real tokens, a sequence-wise load balance over "
                "sequences, a router z-loss over real tokens",
))


routed_batch_balance = ec.register_case(routed_case(
    "routed_batch_balance",
    balance_over="batch",
    regimes=("full_batch", "accumulate:chunks=3", "ddp:world_size=2"),
    expect_mismatch={
        "accumulate": "a batch-wise balance loss: each micro-batch balances by its own expert counts, not the global "
                      "batch's (non-equivalent by construction)",
        "ddp": "a batch-wise balance loss: each rank balances by its own expert counts (non-equivalent by "
               "construction unless the counts are all-reduced)",
    },
    description="routed_tokens with the balance taken over the whole batch's tokens: non-equivalent under any cut, "
                "declared so",
))

routed_bias = ec.register_case(routed_case(
    "routed_bias",
    balance=0.0,
    bias_rate=0.05,
    batch_size=8,
    regimes=("full_batch", "accumulate:chunks=4", "sample_by_sample", "ddp:world_size=2", "fsdp:world_size=2"),
    description="aux-loss-free balancing: the expert bias moved after each optimizer step by the global batch's "
                "routed tokens (summed over ranks)",
))

routed_bias_per_micro_batch = ec.register_case(routed_case(
    "routed_bias_per_micro_batch",
    balance=0.0,
    bias_rate=0.05,
    update_in_backward=True,
    batch_size=8,
    regimes=("full_batch", "accumulate:chunks=4"),
    expect_mismatch={"accumulate": "the expert bias moved after each micro-batch's backward: the next micro-batch "
                                   "routes by a bias the full batch never had"},
    description="aux-loss-free balancing with the bias moved in a backward hook: per micro-batch (torchtitan pull "
                "#1324 moved it to the optimizer step)",
))

# The catalogue's entries that use these cases.
add_entry(Entry("experts: aux loss averaged over data-parallel ranks (aux / dp size)", "routed_tokens",
                "ddp_aux_over_world:world_size=2"))
add_entry(Entry("experts: aux loss scaled by the world size twice", "routed_tokens",
                "ddp_aux_times_world:world_size=2"))
add_entry(Entry("experts: the aux-loss-free bias updated per micro-batch", "routed_bias_per_micro_batch",
                "accumulate:chunks=4", "accumulate:chunks=4", twin_case="routed_bias"))
add_entry(Entry("experts: expert gradients averaged over the expert-parallel group", "routed_tokens",
                "ep_experts_averaged:world_size=2"))
add_entry(Entry("experts: dp x ep, expert gradients averaged over their replicas only (ep times too large)",
                "routed_tokens", "fsdp_ep_experts_over_dp:dp=2,ep=2"))
