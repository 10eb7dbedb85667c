"""A Hugging Face Trainer with gradient_accumulation_steps on a tiny causal LM built from a config (no
download), padded batches of uneven lengths, gated by check_loop (equivcheck.frameworks.trainer_loop).

The case runs in float32: the model's own causal-LM loss upcasts logits to float32, so a float64 case
would compare a float32 loss with the float64 reference's (a margin of 0.16 at float64 tolerance).
"""

import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: `make test-frameworks` installs it")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import equivcheck as ec  # noqa: E402
from equivcheck import Verdict  # noqa: E402
from equivcheck.frameworks import trainer_loop  # noqa: E402

VOCAB, PAD, IGNORE, LENGTH = 32, 0, -100, 8


def tiny_llama():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         pad_token_id=PAD)
    return LlamaForCausalLM(config)


def per_micro_batch_mean_llama():
    """The same model, but the Trainer may not pass num_items_in_batch: each micro-batch's mean, / K."""
    model = tiny_llama()
    model.accepts_loss_kwargs = False
    return model


def sequences():
    """16 sequences of 2 to 8 real tokens, right-padded to 8 (padding never attended: causal)."""
    real = torch.arange(LENGTH) < torch.randint(2, LENGTH + 1, (16,))[:, None]
    input_ids = torch.where(real, torch.randint(1, VOCAB, (16, LENGTH)), PAD)
    return input_ids, torch.where(real, input_ids, IGNORE)


def next_token_losses(output, labels):
    """One loss per predicted token: position t predicts label t + 1, as the model's own loss shifts."""
    logits, labels = output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return F.cross_entropy(logits, labels, reduction="none")[labels != IGNORE]


def predicted_tokens(labels):
    return int((labels[:, 1:] != IGNORE).sum())


CASE = ec.Case(name="tiny_llama", model=tiny_llama, data=sequences, loss=next_token_losses, items=predicted_tokens,
               batch_size=8, steps=2, dtype=torch.float32)


@pytest.fixture
def trainer():
    """The Trainer tests skip unless everything the Trainer needs imports: with transformers alone (no accelerate)
    its import fails, and that is a machine without the Trainer, not a failure of the code checked."""
    pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate, which is not installed: "
                                             "`make test-frameworks` installs it")
    try:
        from transformers import Trainer  # noqa: F401
    except ImportError as error:
        pytest.skip(f"the Hugging Face Trainer cannot be imported here: {error}")


@pytest.mark.parametrize("k", [2, 4])
def test_num_items_in_batch_normalisation_is_equivalent_to_full_batch(k, trainer):
    ec.check_loop(CASE, trainer_loop(gradient_accumulation_steps=k)).assert_equivalent()


def bug_case():
    return dataclasses.replace(CASE, name="tiny_llama_per_micro_batch_mean", model=per_micro_batch_mean_llama)


def test_the_per_micro_batch_mean_is_caught(trainer):
    (outcome,) = ec.check_loop(bug_case(), trainer_loop(gradient_accumulation_steps=4)).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0
    assert outcome.regime == "loop:trainer_loop(gradient_accumulation_steps=4)"


def test_accumulation_steps_that_do_not_divide_the_batch_are_named():
    with pytest.raises(ec.InvalidArgument, match=r"gradient_accumulation_steps=3 is not allowed: expected a divisor"):
        ec.check_loop(CASE, trainer_loop(gradient_accumulation_steps=3))


# --- GPT2LMHeadModel itself, as docs/cases.md teaches: forward=, the model's own loss, loss_reduction="mean" ------

def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def padded_sequences():
    samples = 24
    lengths = torch.randint(2, LENGTH + 1, (samples,))
    real = torch.arange(LENGTH) < lengths[:, None]
    ids = torch.where(real, torch.randint(1, VOCAB, (samples, LENGTH)), PAD)
    return ids, torch.where(real, ids, IGNORE)


OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1),
              "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
              "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3)}


@pytest.mark.filterwarnings("ignore::equivcheck.PrecisionWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_gpt2_under_faithful_accumulation_gives_no_false_alarm(dtype, optimizer):
    """The key bias (a third of c_attn's bias) has a true gradient of zero; in float64 the loss runs in float32."""
    case = ec.Case(name=f"gpt2_{optimizer}", model=tiny_gpt2, data=padded_sequences, batch_size=12, steps=2,
                   dtype=dtype, forward=lambda model, ids, labels: model(input_ids=ids, labels=labels),
                   loss=lambda output, labels: output.loss, loss_reduction="mean",
                   items=lambda labels: int((labels[:, 1:] != IGNORE).sum()),  # the tokens that predict one
                   optimizer=OPTIMIZERS[optimizer])
    for seed in range(6):
        ec.check(case, ["accumulate:chunks=3", "accumulate:chunks=8"], seed=seed).assert_equivalent()
    # the twin: the 2024 trainer bug (each micro-batch's mean / K, uneven token counts) on the same model is caught
    (naive,) = ec.check(case, ["naive_accumulate:chunks=3"]).outcomes
    assert naive.verdict is Verdict.MISMATCH
