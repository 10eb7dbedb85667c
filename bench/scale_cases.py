"""The cases of ``make bench-scale``: models of real size, and the same training written in torch alone.

A GELU MLP in float32 with AdamW, 3 steps of 16 samples, at about 1M, 25M and 100M parameters, and a
GPT-2-shaped transformer of about 124M parameters (12 pre-norm blocks of 768 features, 12 heads, a head tied
to the 50,257-token embedding; block 64, batch 8, 2 steps), and the same shape at 6.5M parameters (128 features,
2 blocks, 4 steps); the LM a team outside the project builds from ``nn.TransformerEncoderLayer`` with a tied head,
at 25M (4 x 384) and 124M (12 x 768), 4 x 64 tokens, 2 steps. Registered at import, so DDP ranks find them.
``train_alone`` is the floor: what a team's own loop does with the same model, data and optimizer.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.case import ModelParameters
from equivcheck_cases.muon import MuonWithAdamW

SAMPLES, STEPS, CLASSES = 16, 3, 10
MLP_SIZES = {"1m": (256, 2), "25m": (1024, 3), "100m": (2048, 3)}  # width, blocks: about 8 * width^2 per block
VOCAB, EMBED, LAYERS, HEADS, BLOCK, GPT_BATCH, GPT_STEPS = 50257, 768, 12, 12, 64, 8, 2
GPU_BATCH, GPU_STEPS, GPU_BLOCK = 8, 4, 256
OUTSIDE_SIZES, OUTSIDE_BATCH = {"25m": (384, 4, 6), "124m": (EMBED, LAYERS, HEADS)}, 4  # embed, layers, heads


def mlp(width: int, blocks: int) -> nn.Module:
    layers = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.GELU())
              for _ in range(blocks)]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def mlp_data(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(SAMPLES * STEPS, width), torch.randint(0, CLASSES, (SAMPLES * STEPS,))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def muon(params) -> torch.optim.Optimizer:
    """Muon over the transformer's blocks' matrices, AdamW over the rest (``params.model``: the model they belong to,
    as a case's optimizer factory receives them)."""
    named = list(params.model.named_parameters())
    hidden = [p for name, p in named if name.startswith("blocks.") and p.ndim == 2]
    return MuonWithAdamW(hidden, [p for name, p in named if not (name.startswith("blocks.") and p.ndim == 2)])


class Block(nn.Module):
    def __init__(self, embed: int = EMBED, heads: int = HEADS) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(embed), nn.LayerNorm(embed)
        self.attn = nn.MultiheadAttention(embed, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(embed, 4 * embed), nn.GELU(), nn.Linear(4 * embed, embed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf"), device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, embed: int = EMBED, layers: int = LAYERS, heads: int = HEADS) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, embed), nn.Embedding(1024, embed)
        self.blocks = nn.Sequential(*(Block(embed, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(embed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.norm(self.blocks(x)) @ self.tokens.weight.T  # the head tied to the embedding


class OutsideLM(nn.Module):
    """A causal LM as a team outside the project builds one from torch's own layers: ``nn.TransformerEncoderLayer``
    (pre-norm, GELU, no dropout) under a causal mask, the head tied to the token embedding."""

    def __init__(self, embed: int = EMBED, layers: int = LAYERS, heads: int = HEADS) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(VOCAB, embed), nn.Parameter(torch.zeros(1024, embed))
        layer = nn.TransformerEncoderLayer(embed, heads, 4 * embed, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(embed), enable_nested_tensor=False)
        self.head = nn.Linear(embed, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.positions[: ids.shape[1]]
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def gpt_data(batch: int = GPT_BATCH, steps: int = GPT_STEPS, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch * steps, block + 1))
    return ids[:, :-1], ids[:, 1:]


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")


CASES = {
    **{f"scale_mlp_{size}": ec.register_case(ec.Case(
        name=f"scale_mlp_{size}", model=partial(mlp, width, blocks), data=partial(mlp_data, width),
        loss=partial(F.cross_entropy, reduction="none"), optimizer=adamw, batch_size=SAMPLES, steps=STEPS,
        dtype=torch.float32, description=f"bench only: a GELU MLP of width {width}, {blocks} blocks, AdamW"))
       for size, (width, blocks) in MLP_SIZES.items()},
    # The same shape, narrow and shallow: where only the attention key biases and the embedding's tail are apart.
    "scale_gpt_6m": ec.register_case(ec.Case(
        name="scale_gpt_6m", model=partial(GPT, 128, 2, 2), data=partial(gpt_data, GPT_BATCH, 4), loss=token_losses,
        items=lambda t: t.numel(), optimizer=adamw, batch_size=GPT_BATCH, steps=4, dtype=torch.float32,
        description="bench only: the GPT-2-shaped transformer at 128 features and 2 blocks (6.5M parameters)")),
    "scale_gpt2_124m": ec.register_case(ec.Case(
        name="scale_gpt2_124m", model=GPT, data=gpt_data, loss=token_losses, items=lambda t: t.numel(),
        optimizer=adamw, batch_size=GPT_BATCH, steps=GPT_STEPS, dtype=torch.float32,
        description="bench only: a GPT-2-shaped transformer (124M parameters), block 64")),
    # The same two, trained by Muon (the blocks' matrices) with AdamW (the rest): a matrix optimizer's check at size.
    "scale_gpt_6m_muon": ec.register_case(ec.Case(
        name="scale_gpt_6m_muon", model=partial(GPT, 128, 2, 2), data=partial(gpt_data, GPT_BATCH, 4),
        loss=token_losses, items=lambda t: t.numel(), optimizer=muon, batch_size=GPT_BATCH, steps=4,
        dtype=torch.float32, description="bench only: the 6.5M GPT-2-shaped transformer under Muon with AdamW")),
    "scale_gpt2_124m_muon": ec.register_case(ec.Case(
        name="scale_gpt2_124m_muon", model=GPT, data=gpt_data, loss=token_losses, items=lambda t: t.numel(),
        optimizer=muon, batch_size=GPT_BATCH, steps=GPT_STEPS, dtype=torch.float32,
        description="bench only: the 124M GPT-2-shaped transformer under Muon with AdamW")),
    # Shaped by a team outside the project (torch's TransformerEncoderLayer, a tied head): 4 x 64 tokens, 2 steps.
    **{f"outside_lm_{size}": ec.register_case(ec.Case(
        name=f"outside_lm_{size}", model=partial(OutsideLM, embed, layers, heads),
        data=partial(gpt_data, OUTSIDE_BATCH, GPT_STEPS), loss=token_losses, items=lambda t: t.numel(),
        optimizer=adamw, batch_size=OUTSIDE_BATCH, steps=GPT_STEPS, dtype=torch.float32,
        description=f"bench only: an LM of torch's TransformerEncoderLayer, {layers} x {embed}, tied head"))
       for size, (embed, layers, heads) in OUTSIDE_SIZES.items()},
    # The GPU's: the sequence a team trains at, batches a GPU spends its time on (bench_gpu.py).
    "gpu_gpt2_124m": ec.register_case(ec.Case(
        name="gpu_gpt2_124m", model=GPT, data=partial(gpt_data, GPU_BATCH, GPU_STEPS, GPU_BLOCK), loss=token_losses,
        items=lambda t: t.numel(), optimizer=adamw, batch_size=GPU_BATCH, steps=GPU_STEPS, dtype=torch.float32,
        description=f"bench only: the 124M GPT-2-shaped transformer, {GPU_BATCH} x {GPU_BLOCK} tokens a step")),
}


def train_alone(case: ec.Case, *, rank: int = 0, world_size: int = 1, chunks: int = 1, device: str = "cpu",
                autocast: torch.dtype | None = None, compile: str | None = None) -> None:
    """The case's training as a team writes it in torch alone (under DDP with ``world_size`` ranks: each rank
    takes its slice of every global batch; with ``chunks``, each global batch accumulated over that many
    micro-batches), from the same seeded start, on ``device``, its forward and loss under ``autocast`` if given, its
    model compiled by the ``compile`` backend if given (the optimizer over the same parameters)."""
    torch.manual_seed(0)
    model = case.model().to(device)
    inputs, targets = (t.to(device) for t in case.data())
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = case.optimizer(ModelParameters(model))  # the model's parameters, as a case's factory receives them
    if compile is not None:
        model = torch.compile(model, backend=compile)
    share = case.batch_size // world_size
    for start in range(0, len(inputs), case.batch_size):
        rank_inputs, rank_targets = (t[start + rank * share : start + (rank + 1) * share] for t in (inputs, targets))
        optimizer.zero_grad()
        for micro_inputs, micro_targets in zip(rank_inputs.chunk(chunks), rank_targets.chunk(chunks)):
            with torch.autocast(torch.device(device).type, dtype=autocast or torch.float32, enabled=autocast is not None):
                losses = case.loss(model(micro_inputs), micro_targets)
            (losses.sum() / losses.numel() / chunks).backward()
        optimizer.step()
