"""HSDP (FSDP2 on a replicate x shard mesh) held to one process on block_stack, with its counts and a twin that
scales the loss by the shard group alone; context parallelism skipped on this CPU in torch's own words, its step
checked where torch runs it (non-causal attention, math backend)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.regimes import register_regime
from equivcheck.regimes.context import ContextParallel, probe
from equivcheck.regimes.fsdp import Hsdp
from equivcheck.strategies import CaseSpec


# --- twins: registered here, imported by the ranks by name ------------------------------------------------------

@register_regime
@dataclasses.dataclass(frozen=True)
class HsdpScaledByShards(Hsdp):
    name = "hsdp_scaled_by_shards"
    summary = ("PITFALL: under HSDP each rank's loss scaled by its shard group's size S, not R * S: FSDP2 averages "
               "over the replicas too, so every gradient is 1/R of the full batch's")
    pitfall = True

    def rank_part(self, objective, batch):
        return lambda output, targets: objective.sum(output, targets) * self.shard / batch.items


@register_regime
@dataclasses.dataclass(frozen=True)
class ContextParallelNonCausal(ContextParallel):
    """``cp`` probing non-causal attention: the step torch runs here (math backend), for a model whose attention is
    not causal."""

    name = "cp_non_causal"
    summary = "cp for models whose attention is not causal (probes that): context_parallel over W ranks"
    causal = False


@register_regime
@dataclasses.dataclass(frozen=True)
class ContextParallelForgetsTheWorldSize(ContextParallelNonCausal):
    name = "cp_forgets_the_world_size"
    summary = "PITFALL: a rank's tokens' sum over the global items, not times W: DDP's average is 1/W too small"
    pitfall = True

    def rank_part(self, objective, batch):
        return lambda output, targets: objective.sum(output, targets) / batch.items


# --- cases: registered at the top level, imported by the ranks ------------------------------------------------

# A causal attention LM (strategies.AttentionLM: nn.MultiheadAttention under a causal mask), sequences of 6 tokens.
ATTENTION = ec.register_case(CaseSpec(widths=(8, 13), activation="gelu", dtype="float64", batch_size=6, steps=2,
                                      loss="cross_entropy", optimizer="adamw", lr=0.01, heads=2, block=6).build())

VOCAB, WIDTH, HEADS, LENGTH = 11, 8, 2, 8


class PositionedAttention(nn.Module):
    """Token and position embeddings (each token carries its position, so a sequence shard keeps its own), one
    non-causal attention layer through F.scaled_dot_product_attention, and a head per position."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.qkv, self.out, self.head = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.tokens(x[..., 0]) + self.positions(x[..., 1])
        samples, length, width = h.shape
        q, k, v = self.qkv(h).view(samples, length, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(samples, length, width)
        return self.head(h + self.out(attended))


def positioned_tokens():
    samples = 12
    tokens = torch.randint(0, VOCAB, (samples, LENGTH))
    positions = torch.arange(LENGTH).expand(samples, LENGTH)
    return torch.stack([tokens, positions], dim=-1), torch.randint(0, VOCAB, (samples, LENGTH))


def token_losses(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")


POSITIONED = ec.register_case(ec.Case(
    name="cp_positioned_attention", model=PositionedAttention, data=positioned_tokens, loss=token_losses,
    items=lambda targets: targets.numel(), batch_size=6, steps=2, dtype=torch.float64,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    description="non-causal attention over token sequences, positions carried with the tokens: context-parallel ready",
))


# --- HSDP --------------------------------------------------------------------------------------------------------

HSDP = ["hsdp:replicate=2,shard=1", "hsdp:replicate=1,shard=2", "hsdp:replicate=2,shard=2"]
TWINS = ["hsdp_scaled_by_shards:replicate=2,shard=1", "hsdp_scaled_by_shards:replicate=2,shard=2"]


@pytest.fixture(scope="module")
def block_stack():
    return ec.check("block_stack", [*HSDP, *TWINS])


@pytest.mark.parametrize("spec", HSDP)
def test_hsdp_matches_full_batch_with_headroom(block_stack, spec):
    outcome = block_stack.outcome("block_stack", spec)
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.margin < 1e-2, outcome.describe()
    assert outcome.result.rank_spread == 0.0


@pytest.mark.parametrize("spec", TWINS)
def test_the_loss_scaled_by_the_shard_group_alone_is_a_mismatch(block_stack, spec):
    """Scaled by S instead of R * S, every gradient is 1/R of the full batch's."""
    outcome = block_stack.outcome("block_stack", spec)
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.margin > 100, outcome.describe()


def test_hsdp_syncs_once_per_block_per_step_whatever_the_mesh(block_stack):
    """5 blocks sharded apart; a block's sync is its reduce-scatter, or with one rank per shard group (2 x 1) its
    replicas' all-reduce, which reduce-scatters nothing."""
    for spec in HSDP:
        result = block_stack.outcome("block_stack", spec).result
        assert result.sync_wrappers == 5 and result.syncs == (5, 5, 5), spec
    traffic = {spec: block_stack.outcome("block_stack", spec).result.collectives for spec in HSDP}
    scattered = {spec: [step["reduce_scatter"][0] for step in steps] for spec, steps in traffic.items()}
    assert scattered == {HSDP[0]: [0, 0, 0], HSDP[1]: [5, 5, 5], HSDP[2]: [5, 5, 5]}


def test_each_rank_holds_its_shard_groups_share(block_stack):
    """Parameter bytes on rank 0: the whole model replicated (2 x 1), half of it (1 x 2 and 2 x 2: 2 shards)."""
    held = {spec: block_stack.outcome("block_stack", spec).result.state_bytes[0] for spec in HSDP}
    assert held[HSDP[0]] == 5528 and held[HSDP[1]] == held[HSDP[2]] < 5528 / 2 + 8 * 18


def test_hsdp_specs_leave_the_derived_world_size_out():
    regime = ec.parse_regime("hsdp:replicate=2,shard=2")
    assert regime.world_size == 4 and str(regime) == "hsdp:replicate=2,shard=2"
    assert ec.parse_regime("hsdp:replicate=2,shard=2,world_size=4") == regime
    assert ec.parse_regime("hsdp:replicate=2,shard=1,reshard_after_forward=0").reshard_after_forward is False
    with pytest.raises(ec.InvalidArgument, match=r"world_size=2 is not allowed: expected replicate \* shard = 4"):
        ec.parse_regime("hsdp:replicate=2,shard=2,world_size=2")
    assert ec.regimes.spec_usage("hsdp") == "hsdp:replicate=N,shard=N[,backend=auto,reshard_after_forward=1,max_norm=inf]"


# --- context parallelism -----------------------------------------------------------------------------------------

@pytest.mark.full_only  # the probe and the check on ranks, 12 s: make test-full
def test_cp_on_an_attention_case_is_skipped_in_torchs_words_where_torch_refuses():
    """On this CPU torch refuses context_parallel with either attention backend: skipped, quoting it, never run."""
    (outcome,) = ec.check(ATTENTION, ["cp:world_size=2"]).outcomes
    found = probe("cpu", "float64")
    if found.ran is not None:  # a torch that runs it here: the check stands as any other
        assert outcome.verdict is not Verdict.SKIPPED, outcome.describe()
        return
    assert outcome.verdict is Verdict.SKIPPED and outcome.result is None, outcome.describe()
    assert outcome.reason == found.reason()
    assert "context_parallel cannot run causal scaled_dot_product_attention" in outcome.reason
    for backend, words in found.refused.items():
        assert words in outcome.reason, backend
    if torch.__version__.startswith("2.13"):  # the words measured here
        assert ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
                "registered.") in outcome.reason
        assert "got mixed torch.Tensor and DTensor" in outcome.reason


def test_cp_fits_sequences_only_and_is_never_drawn():
    with pytest.raises(ec.InvalidArgument, match=r"context parallelism shards sequences, and this case's inputs "
                                                 r"\[36, 6\] and targets \[36\] are not"):
        ec.check("block_stack", ["cp:world_size=2"])
    with pytest.raises(ec.InvalidArgument, match=r"its sequences of 6 do not divide over world_size=4"):
        ec.check(ATTENTION, ["cp:world_size=4"])
    assert ec.REGIMES["cp"].fits_some_cases  # like a TP regime: drawn by equivcheck.strategies only when named
    assert ec.regimes.spec_usage("cp") == "cp:world_size=N[,backend=auto,sdpa=auto]"
    with pytest.raises(ec.InvalidArgument, match=r"sdpa='flash' is not allowed: expected one of auto, default, math"):
        ec.parse_regime("cp:world_size=2,sdpa=flash")


def test_cp_step_reproduces_one_process_where_torch_runs_it():
    """Non-causal attention, which torch's context_parallel runs here with the math backend (asked for by name: the
    probe then tries no other): the whole regime (each rank its half of every sequence, DDP averaging) matches one
    process, and its twin without the world size in the loss does not."""
    report = ec.check(POSITIONED, ["cp_non_causal:world_size=2,sdpa=math",
                                   "cp_forgets_the_world_size:world_size=2,sdpa=math"])
    faithful, forgets = report.outcomes
    if probe("cpu", "float64", False, ("math",)).ran is None:
        assert faithful.verdict is Verdict.SKIPPED and "non-causal" in faithful.reason
        return
    assert faithful.verdict is Verdict.EQUIVALENT and faithful.comparison.margin < 1e-2, faithful.describe()
    assert faithful.result.syncs == (1, 1)
    assert forgets.verdict is Verdict.MISMATCH and forgets.comparison.margin > 100, forgets.describe()
