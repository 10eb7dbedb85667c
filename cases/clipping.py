"""Gradient clipping: the training loop clips once before each optimizer step.

The mlp case with a clipping optimizer: every regime that steps once per global batch clips the whole
accumulated gradient (faithful); clipping after each micro-batch's backward clips partial sums.
MAX_NORM is below the gradient norm of every step, so clipping is active in the reference too.
"""

import dataclasses

from torch import nn

import equivcheck as ec
from equivcheck.regimes.pitfalls import clipping_optimizer
from equivcheck.suites.catalogue import Entry, add_entry

from .experts import RoutedTokens, lm_losses, routed_tokens
from .mlp import mlp
from .tokens import DIM, PAD, VOCAB, token_losses, tokens

MAX_NORM = 0.1

clip_per_micro_batch = ec.register_case(dataclasses.replace(
    mlp,
    name="clip_per_micro_batch",
    optimizer=clipping_optimizer(MAX_NORM),
    regimes=("full_batch", "accumulate:chunks=5", f"clip_per_micro_batch:chunks=5,max_norm={MAX_NORM}"),
    expect_mismatch={"clip_per_micro_batch": f"clipping each partial sum to {MAX_NORM} is not clipping the total once"},
    description=f"pitfall: clip_grad_norm_({MAX_NORM}) per micro-batch; the case clips once before each step",
))

# The catalogue's entries that use these cases.
add_entry(Entry("gradient clipping per micro-batch", "clip_per_micro_batch",
                f"clip_per_micro_batch:chunks=5,max_norm={MAX_NORM}"))

# Clipping on shards (issue 66): FSDP2's and HSDP's own clip counts each logical element once (clip_grad_norm_ over
# DTensors, regime option max_norm=); the pitfalls are the norms teams computed otherwise, each against the reference
# that clips the whole gradient once (full_batch:max_norm=...). MAX_NORM is below the gradient norm at every step.
clip_on_shards = ec.register_case(dataclasses.replace(
    mlp,
    name="clip_on_shards",
    regimes=("full_batch", "fsdp:world_size=2", "hsdp:replicate=2,shard=1"),
    expect_mismatch={"fsdp_clip_averaged": "a mean of the ranks' partial norms is below the whole gradient's norm",
                     "hsdp_clip_over_replicas": "each replica's squares summed again: the norm sqrt(R) times too large"},
    description="the mlp under FSDP2 and HSDP, for the catalogue's norms on shards (clipped at max_norm=0.1 there)",
))


def add_clipped_entry(pitfall: str, case: str, spec: str, max_norm: float) -> None:
    """A catalogue entry of a clip computed otherwise: ``spec`` clipping at ``max_norm``, held to full batch clipped
    there (its twin clips there too)."""
    add_entry(Entry(pitfall, case, f"{spec},max_norm={max_norm}", reference=f"full_batch:max_norm={max_norm}"))


add_clipped_entry("clipping by a norm averaged over the ranks (FSDP2)", "clip_on_shards",
                  "fsdp_clip_averaged:world_size=2", MAX_NORM)
add_clipped_entry("clipping by a norm that counts each replica's elements again (HSDP)", "clip_on_shards",
                  "hsdp_clip_over_replicas:replicate=2,shard=1", MAX_NORM)

# Clipping under expert parallelism (issue 66): ep's and fsdp_ep's own clip counts the dense gradients once and each
# expert from the rank holding it, summed over the ep group; the pitfall counts a rank's own experts alone. The
# embedding and head are frozen (a fine-tune of the experts and router, no shared expert), so the experts hold most
# of the norm and a rank short of the other's is short by much; the loss is weighted by LOSS_WEIGHT, so the clipped
# gradients' elements stand above bf16's absolute tolerance; the norm is above EXPERTS_MAX_NORM at every step.
EXPERTS_MAX_NORM, LOSS_WEIGHT = 2.0, 20.0


def experts_over_frozen_tokens() -> RoutedTokens:
    """routed_tokens' model without its shared expert, its embedding and head frozen: the router and experts train."""
    model = RoutedTokens(shared=False)
    model.embed.requires_grad_(False)
    model.head.requires_grad_(False)
    return model


clip_on_experts = ec.register_case(dataclasses.replace(
    routed_tokens,
    name="clip_on_experts",
    model=experts_over_frozen_tokens,
    loss=lambda output, targets: LOSS_WEIGHT * lm_losses(output, targets),
    regimes=("full_batch", "ep:world_size=2"),  # the matrix's; the clipped ones are the catalogue's and the tests'
    expect_mismatch={"ep_clip_local_experts": "each rank's norm leaves the other rank's experts out: below the "
                                              "whole gradient's",
                     "fsdp_ep_clip_local_experts": "each rank's norm leaves the other ep rank's experts out"},
    description=f"routed_tokens' experts and router over a frozen embedding and head, under ep and fsdp_ep, for the "
                f"catalogue's norms over experts (clipped at max_norm={EXPERTS_MAX_NORM} there)",
))
add_clipped_entry("clipping by a norm that counts the experts on their own rank only (EP)", "clip_on_experts",
                  "ep_clip_local_experts:world_size=2", EXPERTS_MAX_NORM)
add_clipped_entry("clipping by a norm that counts the experts on their own rank only (dp x ep)", "clip_on_experts",
                  "fsdp_ep_clip_local_experts:dp=2,ep=2", EXPERTS_MAX_NORM)


# Clipping on pipeline stages (issue 66): the tokens model with its output layer tied to its input embedding, cut into
# two stages (the embedding in the first, the output layer in the second); pipeline's own clip counts the tied weight
# once (on its first stage), the pitfall on both. The layer between is frozen, so the tied weight is the whole norm;
# weighted and clipped as clip_on_experts is, for bf16's tolerance.
def tied_tokens_model() -> nn.Sequential:
    """tokens' model whose output layer's weight is its input embedding's (no bias: the embedding has none), the
    layer between them frozen: the tied weight trains alone."""
    embed, head = nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(DIM, DIM).requires_grad_(False), nn.Tanh(), head)


STAGES_MAX_NORM = 2.0
clip_on_stages = ec.register_case(dataclasses.replace(
    tokens,
    name="clip_on_stages",
    model=tied_tokens_model,
    loss=lambda output, targets: LOSS_WEIGHT * token_losses(output, targets),
    split=None,
    regimes=("full_batch", "pipeline:stages=2,microbatches=4"),
    expect_mismatch={"pipeline_clip_tied_per_stage": "the tied embedding's squares counted on both stages: the norm "
                                                     "above the whole gradient's"},
    description=f"tokens' model with its output layer tied to its embedding, on two pipeline stages, for the "
                f"catalogue's norm over stages (clipped at max_norm={STAGES_MAX_NORM} there)",
))
add_clipped_entry("clipping by a norm that counts a tied weight on every stage (PP)", "clip_on_stages",
                  "pipeline_clip_tied_per_stage:stages=2,microbatches=4", STAGES_MAX_NORM)
