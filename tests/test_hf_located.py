"""Where a run parts, on a model equivcheck did not write (issue 65): Transformers' own GPT2LMHeadModel, built from a
config (no download), float64, with one change planted at a time by the team's step, each located in the module that
holds it: block 2's exact GELU swapped for its tanh approximation, block 3's ln_2 swapped for a fused LayerNorm whose
backward drops a term, and block 1's activation changed in a model the step compiles."""

import os
import weakref

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: `make test-frameworks` installs it")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.activations import NewGELUActivation  # noqa: E402

import equivcheck as ec  # noqa: E402

VOCAB, LENGTH = 50, 12


def tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=4, n_head=2,
                                      activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def tokens():
    ids = torch.randint(0, VOCAB, (48, LENGTH))
    return ids, ids


def next_token_losses(output, labels):
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none")


CASE = ec.Case(name="tiny_gpt2", model=tiny_gpt2, data=tokens, loss=next_token_losses,
               items=lambda labels: labels[:, 1:].numel(), batch_size=12, steps=4)

pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def full_batch(model, optimizer, batch):
    ids, labels = batch
    optimizer.zero_grad()
    next_token_losses(model(ids), labels).mean().backward()
    optimizer.step()


def approximates_block_2s_gelu(model, optimizer, batch):
    mlp = model.transformer.h[2].mlp
    if not isinstance(mlp.act, NewGELUActivation):
        mlp.act = NewGELUActivation()
    full_batch(model, optimizer, batch)


class _LayerNormDroppingATerm(torch.autograd.Function):
    """LayerNorm whose backward leaves out the mean of the normalised gradient's projection (a fused kernel's bug)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        normed = (x - mean) / torch.sqrt(var + eps)
        ctx.save_for_backward(normed, weight, torch.sqrt(var + eps))
        return normed * weight + bias

    @staticmethod
    def backward(ctx, grad):
        normed, weight, std = ctx.saved_tensors
        g = grad * weight
        grad_x = (g - g.mean(-1, keepdim=True)) / std  # the term in normed * mean(g * normed) left out
        return grad_x, (grad * normed).flatten(0, -2).sum(0), grad.flatten(0, -2).sum(0), None


class FusedLayerNorm(nn.Module):
    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x):
        return _LayerNormDroppingATerm.apply(x, self.weight, self.bias, self.eps)


def fuses_block_3s_ln_2(model, optimizer, batch):
    block = model.transformer.h[3]
    if not isinstance(block.ln_2, FusedLayerNorm):
        block.ln_2 = FusedLayerNorm(block.ln_2)
    full_batch(model, optimizer, batch)


COMPILED = weakref.WeakKeyDictionary()


def compiles_with_block_1s_act_changed(model, optimizer, batch):
    if optimizer not in COMPILED:
        model.transformer.h[1].mlp.act = NewGELUActivation()
        torch._dynamo.reset()
        COMPILED[optimizer] = torch.compile(model, backend="aot_eager")
    full_batch(COMPILED[optimizer], optimizer, batch)


def compiles(model, optimizer, batch):
    if optimizer not in COMPILED:
        torch._dynamo.reset()
        COMPILED[optimizer] = torch.compile(model, backend="aot_eager")
    full_batch(COMPILED[optimizer], optimizer, batch)


def located(step_fn):
    (outcome,) = ec.check_step(CASE, step_fn).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH, outcome.describe()
    return outcome.location


def test_gpt2s_faithful_steps_are_equivalent_eager_and_compiled():
    assert ec.check_step(CASE, full_batch).outcomes[0].verdict is ec.Verdict.EQUIVALENT
    assert ec.check_step(CASE, compiles).outcomes[0].verdict is ec.Verdict.EQUIVALENT


def test_block_2s_gelu_approximated_is_located_in_its_activation():
    location = located(approximates_block_2s_gelu)
    assert (location.step, location.phase, location.module) == (0, "forward", "transformer.h.2.mlp.act"), location


def test_block_3s_ln_2_swapped_for_a_fused_one_is_located_in_its_backward():
    location = located(fuses_block_3s_ln_2)
    assert (location.step, location.phase, location.module) == (0, "backward", "transformer.h.3.ln_2"), location


def test_block_1s_activation_changed_in_a_compiled_model_is_located_in_it():
    location = located(compiles_with_block_1s_act_changed)
    assert (location.step, location.phase, location.module) == (0, "forward", "transformer.h.1.mlp.act"), location
