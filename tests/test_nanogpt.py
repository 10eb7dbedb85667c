"""A team training a nanoGPT-shaped model checks its own training step, as written, with no wrapper class.

The model has nanoGPT's shape (token and position embeddings, causal self-attention blocks, tied head) and
its interfaces: ``forward(idx, targets)`` returns ``(logits, loss)``, and ``configure_optimizers`` builds
AdamW with weight decay on matrices only. The step is nanoGPT's: ``loss / K`` per micro-step and, under
DDP, ``require_backward_grad_sync`` set for the last micro-step only.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

VOCAB, BLOCK, EMBED, HEADS, LAYERS = 17, 6, 12, 2, 2
MICRO_STEPS = 3  # nanoGPT's gradient_accumulation_steps (per rank under DDP)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.c_attn, self.c_proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED))

    def forward(self, x):
        batch, time, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(EMBED, dim=2)
        q, k, v = (t.view(batch, time, HEADS, EMBED // HEADS).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, time, EMBED)
        x = x + self.c_proj(attended)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBED), nn.Embedding(BLOCK, EMBED)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBED)
        self.lm_head = nn.Linear(EMBED, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:  # inference: the last position only, as nanoGPT
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=betas)


def get_batch():
    tokens = torch.randint(0, VOCAB, (24, BLOCK + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # nanoGPT stacks contiguous x and y


CASE = ec.register_case(ec.Case(
    name="nanogpt_like", model=GPT, data=get_batch, batch_size=12, steps=2,
    forward=lambda model, idx, targets: model(idx, targets),  # the model computes its own loss
    loss=lambda output, targets: output[1], loss_reduction="mean",  # nanoGPT's loss: the mean over its tokens
    items=lambda targets: int((targets != -1).sum()),
    optimizer=lambda params: params.model.configure_optimizers(0.1, 1e-3, (0.9, 0.95)),
))


def train_step(model, optimizer, batch):
    """nanoGPT's inner loop, for one optimizer step."""
    inputs, targets = batch
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    for micro_step, (x, y) in enumerate(zip(inputs.tensor_split(MICRO_STEPS), targets.tensor_split(MICRO_STEPS))):
        if ddp:
            model.require_backward_grad_sync = micro_step == MICRO_STEPS - 1
        logits, loss = model(x, y)
        (loss / MICRO_STEPS).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return None


def train_step_syncing_every_micro_step(model, optimizer, batch):
    """The same step without require_backward_grad_sync: right numbers, an all-reduce per micro-step."""
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(MICRO_STEPS), targets.tensor_split(MICRO_STEPS)):
        logits, loss = model(x, y)
        (loss / MICRO_STEPS).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_with_local_batch_mean(model, optimizer, batch):
    """A bug: every micro-step's loss summed, not averaged (the / K forgotten)."""
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(MICRO_STEPS), targets.tensor_split(MICRO_STEPS)):
        model(x, y)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore::equivcheck.BlindSpotWarning")
def test_the_built_in_regimes_run_the_model_with_its_own_loss(equivcheck):
    # ddp_mean_loss is a pitfall that every sample's equal token count makes exact here: it is run for its forward
    equivcheck.check(CASE, ["accumulate:chunks=3", "sample_by_sample", "ddp:world_size=2",
                            "ddp_no_sync:world_size=2,chunks=2", "ddp_mean_loss:world_size=2"])


@pytest.mark.filterwarnings("ignore::equivcheck.BlindSpotWarning")
def test_nanogpts_step_in_one_process_and_on_two_ranks(equivcheck):
    equivcheck.check_step(CASE, train_step)
    report = equivcheck.check_step(CASE, train_step, world_size=2)
    assert report.outcomes[0].result.syncs == (1, 1)  # one all-reduce per optimizer step


@pytest.mark.filterwarnings("ignore::equivcheck.BlindSpotWarning")
def test_its_twins_are_caught():
    (forgotten,) = ec.check_step(CASE, train_step_with_local_batch_mean).outcomes
    assert forgotten.verdict is ec.Verdict.MISMATCH
    assert forgotten.comparison.hint.startswith("every gradient is 3 x the reference's")
    (every,) = ec.check_step(CASE, train_step_syncing_every_micro_step, world_size=2).outcomes
    assert every.verdict is ec.Verdict.COMMUNICATION and every.result.syncs == (3, 3)


def test_without_forward_the_model_returns_last_position_logits_and_the_problem_is_named():
    plain = dataclasses.replace(CASE, name="nanogpt_like_plain_forward", forward=None,
                                loss=lambda output, targets: F.cross_entropy(output.view(-1, VOCAB), targets.view(-1)),
                                loss_reduction="mean")
    with pytest.raises(ec.InvalidArgument, match=r"returned a tuple of \(Tensor \(12, 1, 17\), NoneType\)"):
        ec.check(plain, ["accumulate:chunks=3"])
