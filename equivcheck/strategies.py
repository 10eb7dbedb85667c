"""Hypothesis strategies for fuzzing equivalence: batch sizes, chunkings, world sizes, regime specs
and whole small cases.

    from equivcheck.strategies import cases, regime_specs
    @given(case=cases(), data=st.data())
    def test_accumulation(case, data):
        spec = data.draw(regime_specs(case.batch_size, names=["accumulate"]))
        ec.check(case, [spec]).assert_equivalent()

Needs hypothesis (equivcheck's ``test`` extra); ``import equivcheck`` alone does not import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from .aggregation import MODES as AGGREGATIONS, Aggregated
from .case import Case
from .packing import POSITIONS, TOKENS, document_mask, padded
from .precision import NAMES_OF_DTYPES, PRECISIONS
from .errors import InvalidArgument, expect_int
from .regimes import REGIMES, parse_regime

__all__ = ["ACTIVATIONS", "AttentionLM", "CaseSpec", "attention_cases", "attention_specs", "batch_sizes", "case_specs",
           "cases", "chunkings", "regime_specs", "world_sizes"]

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "sigmoid": nn.Sigmoid, "silu": nn.SiLU}


def batch_sizes(min_size: int = 1, max_size: int = 64) -> st.SearchStrategy[int]:
    """Global batch sizes (samples per optimizer step), primes drawn as often as any size: a prime
    batch has no even chunking but one."""
    expect_int("min_size", min_size)
    expect_int("max_size", max_size, minimum=min_size)
    primes = [n for n in range(max(min_size, 2), max_size + 1) if all(n % d for d in range(2, int(n ** 0.5) + 1))]
    sizes = st.integers(min_size, max_size)
    return st.one_of(sizes, st.sampled_from(primes)) if primes else sizes


def chunkings(batch_size: int, *, uneven: bool = False) -> st.SearchStrategy[int]:
    """Chunk counts 2..batch_size (1 for a batch of one: one chunk is the full batch, nothing to fuzz);
    ``uneven``: only counts that cut the batch into unequal chunks."""
    expect_int("batch_size", batch_size)
    if not uneven:
        return st.integers(min(2, batch_size), batch_size)
    counts = [k for k in range(2, batch_size + 1) if batch_size % k]
    if not counts:
        raise InvalidArgument.value("batch_size", batch_size, "a batch size with an uneven chunking (3 or more)")
    return st.sampled_from(counts)


def world_sizes(min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[int]:
    """Numbers of distributed ranks, min_size..max_size."""
    expect_int("min_size", min_size)
    expect_int("max_size", max_size, minimum=min_size)
    return st.integers(min_size, max_size)


def regime_specs(
    batch_size: int,
    names: Iterable[str] | None = None,
    *,
    pitfalls: bool = False,
    min_world_size: int = 1,
    max_world_size: int = 4,
) -> st.SearchStrategy[str]:
    """Specs such as ``accumulate:chunks=7`` or ``ddp_no_sync:world_size=3,chunks=2`` for a global batch
    of ``batch_size``.

    ``names``: the regimes to draw from (default: every registered one whose parameters can be drawn,
    pitfalls only if asked, traps never). Parameters are drawn by meaning: ``world_size`` from :func:`world_sizes`
    (at most the batch size), then ``chunks`` from :func:`chunkings` of the smallest shard a rank
    gets; parameters with a default keep it. A named regime with another required parameter is refused.
    """
    expect_int("batch_size", batch_size)
    expect_int("max_world_size", max_world_size, minimum=min_world_size)
    drawable = {"chunks", "world_size"}

    def required(name: str) -> list[str]:
        return [f.name for f in dataclasses.fields(REGIMES[name])
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    if names is None:  # traps crash in PyTorch itself: never drawn as a regime that must stay equivalent; a regime
        # that fits only some cases (a tensor-parallel plan, a sequence to cut) is drawn only when named
        chosen = [n for n, cls in REGIMES.items()
                  if (pitfalls or not cls.pitfall) and not cls.trap and not cls.fits_some_cases
                  and set(required(n)) <= drawable]
    else:
        chosen = list(names)
        for name in chosen:
            if name not in REGIMES:
                raise InvalidArgument.unknown("regime", name, REGIMES)
            unknown = [f for f in required(name) if f not in drawable]
            if unknown:
                raise InvalidArgument(f"regime {name!r} needs {unknown[0]}=..., which regime_specs cannot draw: "
                                      f"it draws {', '.join(sorted(drawable))}")

    def spec_of(name: str) -> st.SearchStrategy[str]:
        fields = [f.name for f in dataclasses.fields(REGIMES[name]) if f.name in drawable]

        def with_world_size(world_size: int) -> st.SearchStrategy[str]:
            draws = {"world_size": st.just(world_size), "chunks": chunkings(batch_size // world_size)}
            values = st.fixed_dictionaries({f: draws[f] for f in fields})
            # Canonical specs (parameters left at their default are omitted), as equivcheck prints them.
            return values.map(lambda v: str(parse_regime(f"{name}:" + ",".join(f"{k}={v[k]}" for k in fields))))

        if "world_size" in fields:
            if min_world_size > batch_size:
                raise InvalidArgument.value("min_world_size", min_world_size,
                                            f"at most batch_size={batch_size} (every rank needs a sample)")
            return world_sizes(min_world_size, min(max_world_size, batch_size)).flatmap(with_world_size)
        return with_world_size(1)

    return st.one_of([spec_of(name) for name in chosen])


class _Classifier(nn.Sequential):
    """An MLP trunk (every layer but the last) under a linear head: split for detached_partial."""

    def split(self):
        return self[:-1], self[-1]


OPTIMIZERS = ("sgd", "momentum", "nesterov", "weight_decay", "adam", "adamw")
# Adam with an epsilon far below any gradient's rounding: a true gradient of zero, computed as noise, then
# makes whole-size updates in float64 too (the attention key bias's false alarm; equivcheck.judge.witness).
NO_EPS_OPTIMIZERS = ("adam_no_eps", "adamw_no_eps")
TINY_EPS = 1e-30
NORMS = ("none", "layernorm", "groupnorm")
# Learning rates per optimizer family: SGD's up to 0.5 (with momentum, the float32 false alarm),
# Adam's up to 0.1 (every update is about lr, whatever the gradient's size).
LEARNING_RATES = {"sgd": (0.01, 0.1, 0.5), "adam": (1e-3, 1e-2, 1e-1)}


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """Everything a drawn case is, in plain values: ``build()`` makes the same case in any process
    (a DDP rank rebuilds it from these values)."""

    widths: tuple[int, ...]  # input features (the embedding width with a vocabulary), hidden widths, classes
    activation: str
    dtype: str
    batch_size: int
    steps: int
    loss: str
    norm: str = "none"  # after every hidden Linear: none, layernorm or groupnorm
    groups: tuple[int, ...] = ()  # GroupNorm's group count per hidden layer (divides its width; 0: none)
    vocab: int = 0  # > 0: the inputs are token ids through an Embedding(vocab, widths[0])
    optimizer: str = "sgd"
    lr: float = 0.1
    batchnorm: bool = False
    heads: int = 0  # > 0: a causal attention LM over token sequences (AttentionLM): widths are (dim, vocab)
    block: int = 0  # the attention LM's sequence length (padded)
    attention_bias: bool = True  # the attention's in-projection bias, whose key part has a true gradient of zero
    tied: bool = False  # the LM's head shares the token embedding's weight
    split_attention: bool = False  # q, k, v and output projections of their own (SplitAttention), not fused
    # The attention LM's 2025-2026 shapes: its objective an RL trainer's (each sequence's token losses weighted by
    # its advantage, aggregated as the mode says: equivcheck.aggregation; "" the plain token mean), its MLP frozen
    # and adapted by LoRA, its documents packed (the documents layout, attention within each document).
    aggregation: str = ""
    adapters: bool = False
    packed: bool = False

    @property
    def name(self) -> str:
        parts = ["drawn", "x".join(map(str, self.widths)), self.activation, self.dtype, f"b{self.batch_size}",
                 f"s{self.steps}", self.loss, self.optimizer, f"lr{self.lr:g}"]
        parts += [self.norm + "".join(f"g{g}" for g in self.groups)] if self.norm != "none" else []
        parts += [f"vocab{self.vocab}"] if self.vocab else []
        parts += [f"attn{self.heads}h_block{self.block}" + ("_bias" if self.attention_bias else "")
                  + ("_tied" if self.tied else "") + ("_split" if self.split_attention else "")
                  + (f"_{self.aggregation}" if self.aggregation else "") + ("_lora" if self.adapters else "")
                  + ("_packed" if self.packed else "")] if self.heads else []
        return "_".join(parts + (["batchnorm"] if self.batchnorm else []))

    def build(self) -> Case:
        if self.heads:
            loss, items = partial(_token_losses, self.widths[-1]), _real_tokens
            if self.aggregation:
                objective = Aggregated(partial(_weighted_token_losses, self.widths[-1]), _counted, self.aggregation,
                                       self.block if self.aggregation == "seq-mean-token-sum-norm" else 0)
                loss, items = objective.loss, objective.units
            data = _documents if self.packed else _rollouts if self.aggregation else _token_data
            return Case(
                name=self.name, model=partial(AttentionLM.of, self), data=partial(data, self),
                loss=loss, items=items, batch_size=self.batch_size,
                steps=self.steps, optimizer=partial(_optimizer, self.optimizer, self.lr),
                split=None if self.tied else AttentionLM.split, dtype=PRECISIONS[self.dtype].dtype,
                description=f"drawn by equivcheck.strategies.attention_cases: {self}",
            )
        declared = {}
        if self.batchnorm:
            declared = {r: "BatchNorm normalises each micro-batch by its own statistics"
                        for r in ("accumulate", "sample_by_sample")}
        return Case(
            name=self.name,
            model=partial(_model, self),
            data=partial(_data, self),
            loss=partial(F.cross_entropy, reduction="none") if self.loss == "cross_entropy" else _squared_error,
            batch_size=self.batch_size,
            steps=self.steps,
            optimizer=partial(_optimizer, self.optimizer, self.lr),
            split=_Classifier.split,
            expect_mismatch=declared,
            dtype=PRECISIONS[self.dtype].dtype,
            description=f"drawn by equivcheck.strategies.cases: {self}",
        )


def _model(spec: CaseSpec) -> nn.Module:
    widths = spec.widths
    layers: list[nn.Module] = [nn.Embedding(spec.vocab, widths[0])] if spec.vocab else []
    for i, (width_in, width_out) in enumerate(zip(widths[:-2], widths[1:-1])):
        layers.append(nn.Linear(width_in, width_out))
        if spec.batchnorm and i == 0:
            layers.append(nn.BatchNorm1d(width_out))
        if spec.norm == "layernorm":
            layers.append(nn.LayerNorm(width_out))
        elif spec.norm == "groupnorm" and spec.groups[i]:
            layers.append(nn.GroupNorm(spec.groups[i], width_out))
        layers.append(ACTIVATIONS[spec.activation]())
    layers.append(nn.Linear(widths[-2], widths[-1]))
    return _Classifier(*layers)


def _data(spec: CaseSpec):
    samples, classes = spec.steps * spec.batch_size, spec.widths[-1]
    inputs = torch.randint(0, spec.vocab, (samples,)) if spec.vocab else torch.randn(samples, spec.widths[0])
    targets = torch.randint(0, classes, (samples,)) if spec.loss == "cross_entropy" else torch.randn(samples, classes)
    return inputs, targets


def _optimizer(name: str, lr: float, params) -> torch.optim.Optimizer:
    eps = TINY_EPS if name in NO_EPS_OPTIMIZERS else 1e-8
    if name.startswith("adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=1e-2, eps=eps)
    if name.startswith("adam"):
        return torch.optim.Adam(params, lr=lr, eps=eps)
    momentum = {"sgd": 0.0}.get(name, 0.9)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nesterov",
                           weight_decay=1e-2 if name == "weight_decay" else 0.0)


PAD, IGNORE = 0, -100  # the attention LM's padding token, and the target of a padded position


class AttentionLM(nn.Module):
    """A tiny pre-norm causal transformer: token and learned position embeddings, one block of multi-head
    attention under a causal mask (right padding: a real token never attends to a pad) and an MLP, a final
    LayerNorm and a head, tied to the token embedding or not. Split for detached_partial: (trunk, head)."""

    def __init__(self, vocab: int, dim: int, heads: int, block: int, bias: bool, tied: bool,
                 split_attention: bool = False, adapters: bool = False, packed: bool = False) -> None:
        super().__init__()
        self.trunk = _AttentionTrunk(vocab, dim, heads, block, bias, split_attention or packed, adapters, packed)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.trunk.tokens.weight

    @classmethod
    def of(cls, spec: CaseSpec) -> AttentionLM:
        return cls(spec.widths[-1], spec.widths[0], spec.heads, spec.block, spec.attention_bias, spec.tied,
                   spec.split_attention, spec.adapters, spec.packed)

    def forward(self, tokens):
        return self.head(self.trunk(tokens))

    def split(self):
        return self.trunk, self.head


class _AttentionTrunk(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, block: int, bias: bool, split: bool, adapters: bool = False,
                 packed: bool = False) -> None:
        super().__init__()
        self.packed = packed
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.norm1, self.norm2, self.norm_final = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = (SplitAttention(dim, heads, bias) if split else
                     nn.MultiheadAttention(dim, heads, bias=bias, batch_first=True))
        linear = LoRALinear if adapters else nn.Linear
        self.mlp = nn.Sequential(linear(dim, 4 * dim), nn.GELU(), linear(4 * dim, dim))

    def forward(self, tokens):
        if self.packed:  # the documents layout: each slot's token and position, attention within its document
            x = self.tokens(tokens[:, TOKENS]) + self.positions(tokens[:, POSITIONS])
            blocked = ~document_mask(tokens)[:, None]
        else:
            length = tokens.shape[1]
            x = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
            blocked = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        h = self.norm1(x)
        if isinstance(self.attn, SplitAttention):
            x = x + self.attn(h, blocked)
        else:
            x = x + self.attn(h, h, h, attn_mask=blocked, need_weights=False)[0]
        return self.norm_final(x + self.mlp(self.norm2(x)))


class LoRALinear(nn.Module):
    """A frozen Linear adapted by rank-2 LoRA, ``base(x) + 2 * (x A^T) B^T``, both factors drawn small and nonzero
    (LoRA's own zero B would leave A without a gradient at the first step)."""

    def __init__(self, features: int, out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(features, out).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + 2.0 * (x @ self.lora_a.T) @ self.lora_b.T


class SplitAttention(nn.Module):
    """Multi-head self-attention with projections of their own, as Llama's and torchtitan's: a tensor-parallel plan
    shards q, k and v by heads (kept local per rank) and the output projection by its inputs, and ``n_heads`` counts
    the heads this rank holds (the derived plan divides it by the TP size)."""

    def __init__(self, dim: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=bias) for _ in range(4))
        self.n_heads = heads

    def forward(self, x, blocked):
        """``blocked``: True where a position may not attend (the causal mask)."""
        samples, length, _ = x.shape
        q, k, v = (proj(x).view(samples, length, self.n_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked)
        return self.o_proj(attended.transpose(1, 2).reshape(samples, length, -1))


def _token_data(spec: CaseSpec):
    samples, vocab = spec.steps * spec.batch_size, spec.widths[-1]
    lengths = torch.randint(1, spec.block + 1, (samples,))
    real = torch.arange(spec.block) < lengths[:, None]
    tokens = torch.where(real, torch.randint(1, vocab, (samples, spec.block)), PAD)
    targets = torch.where(real, torch.randint(0, vocab, (samples, spec.block)), IGNORE)
    return tokens, targets


def _token_losses(vocab: int, logits, targets):
    flat = targets.reshape(-1)
    losses = F.cross_entropy(logits.reshape(-1, vocab), flat, reduction="none", ignore_index=IGNORE)
    return losses[flat != IGNORE]  # one loss per real token


def _rollouts(spec: CaseSpec):
    """The padded token data with each sequence's advantage beside every target (float: ``(samples, block, 2)``)."""
    tokens, targets = _token_data(spec)
    advantages = torch.randn(len(targets), 1).expand(-1, spec.block)
    return tokens, torch.stack([targets.to(torch.float64), advantages.to(torch.float64)], dim=-1)


def _weighted_token_losses(vocab: int, logits, targets):
    """``(sequences, tokens)``: each target token's cross-entropy times its sequence's advantage (0 where padded)."""
    ids = targets[..., 0].long()
    losses = F.cross_entropy(logits.reshape(-1, vocab), ids.reshape(-1), reduction="none", ignore_index=IGNORE)
    return losses.view_as(ids) * targets[..., 1]


def _counted(targets):
    return targets[..., 0] != IGNORE


def _documents(spec: CaseSpec):
    """Documents of 2 to ``block + 1`` tokens, one a row (equivcheck.packing's documents layout)."""
    lengths = torch.randint(2, spec.block + 2, (spec.steps * spec.batch_size,))
    return padded([torch.randint(1, spec.widths[-1], (int(n),)) for n in lengths], spec.block)


def _real_tokens(targets) -> int:
    return int((targets != IGNORE).sum())


def _squared_error(output, target):
    return ((output - target) ** 2).mean(dim=1)  # one loss per sample


@st.composite
def case_specs(
    draw,
    *,
    depths: st.SearchStrategy[int] = st.integers(0, 3),
    widths: st.SearchStrategy[int] = st.integers(1, 32),
    activations: st.SearchStrategy[str] = st.sampled_from(sorted(ACTIVATIONS)),
    dtypes: st.SearchStrategy[str] = st.sampled_from(sorted(NAMES_OF_DTYPES.values())),
    batch_sizes: st.SearchStrategy[int] = batch_sizes(),
    steps: st.SearchStrategy[int] = st.integers(1, 4),
    losses: st.SearchStrategy[str] = st.sampled_from(["cross_entropy", "squared_error"]),
    optimizers: st.SearchStrategy[str] = st.sampled_from(OPTIMIZERS),
    norms: st.SearchStrategy[str] = st.sampled_from(NORMS),
    embeddings: st.SearchStrategy[bool] = st.booleans(),
    batchnorm: bool = False,
) -> CaseSpec:
    """The plain values of a drawn case (see :func:`cases`)."""
    depth = draw(depths)
    if batchnorm:
        depth = max(depth, 1)
    shape = tuple(draw(widths) for _ in range(depth + 1)) + (draw(st.integers(2, 5)),)
    norm = draw(norms)
    # At least 2 channels a group: with one, a sample alone (a micro-batch of 1) has nothing to normalise
    # and torch refuses it; 0 leaves a layer of width 1 without GroupNorm.
    groups = tuple(draw(st.sampled_from([g for g in range(1, w // 2 + 1) if w % g == 0] or [0])) for w in shape[1:-1]) \
        if norm == "groupnorm" else ()
    optimizer = draw(optimizers)
    family = "adam" if optimizer.startswith("adam") else "sgd"
    return CaseSpec(
        widths=shape, activation=draw(activations), dtype=draw(dtypes), batch_size=draw(batch_sizes),
        steps=draw(steps), loss=draw(losses), norm=norm, groups=groups,
        vocab=draw(st.integers(2, 16)) if draw(embeddings) else 0, optimizer=optimizer,
        lr=draw(st.sampled_from(LEARNING_RATES[family])), batchnorm=batchnorm,
    )


def cases(**options) -> st.SearchStrategy[Case]:
    """Small MLP cases: ``depth`` hidden layers of drawn widths (down to 1) and activation, optionally a
    LayerNorm or GroupNorm after each and an embedding in front; a dtype, a batch size (up to 64, primes
    included), a number of steps, a loss and an optimizer (SGD plain, with momentum, nesterov or weight
    decay; Adam; AdamW). ``batchnorm`` puts a BatchNorm1d after the first hidden layer (depth >= 1): the
    accumulation pitfall, which such a case declares. Options are :func:`case_specs`'s strategies."""
    return case_specs(**options).map(CaseSpec.build)


@st.composite
def attention_specs(
    draw,
    *,
    dims: st.SearchStrategy[int] = st.sampled_from([4, 8, 12, 16]),
    heads: st.SearchStrategy[int] = st.sampled_from([1, 2, 4]),
    blocks: st.SearchStrategy[int] = st.integers(2, 8),
    vocabs: st.SearchStrategy[int] = st.integers(3, 16),
    dtypes: st.SearchStrategy[str] = st.sampled_from(sorted(NAMES_OF_DTYPES.values())),
    batch_sizes: st.SearchStrategy[int] = batch_sizes(1, 32),
    steps: st.SearchStrategy[int] = st.integers(1, 4),
    optimizers: st.SearchStrategy[str] = st.sampled_from(("sgd", "momentum", "adam", "adamw", *NO_EPS_OPTIMIZERS)),
    split_attention: st.SearchStrategy[bool] = st.just(False),
    aggregations: st.SearchStrategy[str] = st.sampled_from(("", "", *AGGREGATIONS)),
    adapters: st.SearchStrategy[bool] = st.booleans(),
    packed: st.SearchStrategy[bool] = st.booleans(),
) -> CaseSpec:
    """The plain values of a drawn attention LM case (see :func:`attention_cases`)."""
    dim = draw(dims)
    optimizer = draw(optimizers)
    aggregation = draw(aggregations)
    documents = not aggregation and draw(packed)  # packed documents keep the plain token mean
    return CaseSpec(
        widths=(dim, draw(vocabs)), activation="gelu", dtype=draw(dtypes), batch_size=draw(batch_sizes),
        steps=draw(steps), loss="cross_entropy", optimizer=optimizer,
        lr=draw(st.sampled_from(LEARNING_RATES["adam" if optimizer.startswith("adam") else "sgd"])),
        heads=draw(heads.filter(lambda h: dim % h == 0)), block=draw(blocks), attention_bias=draw(st.booleans()),
        tied=draw(st.booleans()), split_attention=draw(split_attention), aggregation=aggregation,
        adapters=draw(adapters), packed=documents,
    )


def attention_cases(**options) -> st.SearchStrategy[Case]:
    """Tiny causal attention LMs (:class:`AttentionLM`) on right-padded token sequences whose padded targets are
    ignored (the mean is over real tokens): a width, heads, a sequence length, a vocabulary, the in-projection
    bias on or off (its key part has a true gradient of zero: softmax ignores a constant added to a row), a head
    tied to the embedding or not, a dtype, a batch, steps and an optimizer (SGD, with momentum, Adam, AdamW, and
    Adam without epsilon, where the key bias's rounding noise makes whole-size updates); ``split_attention``
    draws :class:`SplitAttention` (projections of their own, which a tensor-parallel plan shards by heads) instead of
    ``nn.MultiheadAttention``. The shapes teams moved to are drawn beside the plain LM: an RL trainer's objective
    (``aggregations``: each sequence's token losses weighted by its drawn advantage, aggregated by one of
    ``ec.AGGREGATIONS``), an MLP frozen and adapted by LoRA (``adapters``), documents in the packed layout
    (``packed``: equivcheck.packing's documents one a row, attention within each; the ``packed`` regimes pack them).
    Options are :func:`attention_specs`'s strategies."""
    return attention_specs(**options).map(CaseSpec.build)
