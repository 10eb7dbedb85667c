"""A Lightning Trainer configuration gated by check_loop (equivcheck.frameworks.lightning_loop).

Lightning steps with ``optimizer.step(closure)``: these are the rows that were false alarms before
the closure fix, and the bug that must still be caught.
"""

import pytest

pl = pytest.importorskip("pytorch_lightning", reason="Lightning is not installed: `make test-frameworks` installs it")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import equivcheck as ec  # noqa: E402
from equivcheck import Verdict  # noqa: E402
from equivcheck.frameworks import lightning_loop  # noqa: E402
from framework_references import CLIP, clipped_full_batch  # noqa: E402


class Classifier(pl.LightningModule):
    """A team's module around the case's model; ``divide_by`` divides the loss again (the bug)."""

    def __init__(self, model, divide_by=1):
        super().__init__()
        self.model = model
        self.divide_by = divide_by

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.cross_entropy(self.model(inputs), targets) / self.divide_by


@pytest.mark.parametrize("k", [2, 4])
def test_accumulate_grad_batches_is_equivalent_to_full_batch(k):
    ec.check_loop("mlp", lightning_loop(Classifier, accumulate_grad_batches=k)).assert_equivalent()


@pytest.mark.parametrize("k", [2, 4])
def test_gradient_clipping_is_equivalent_to_full_batch_clipped_the_same(k):
    loop = lightning_loop(Classifier, accumulate_grad_batches=k, gradient_clip_val=CLIP)
    ec.check_loop("mlp", loop, reference=clipped_full_batch).assert_equivalent()


def test_a_module_that_divides_by_k_on_top_of_lightning_is_caught():
    loop = lightning_loop(lambda model: Classifier(model, divide_by=4), accumulate_grad_batches=4)
    (outcome,) = ec.check_loop("mlp", loop).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0
    assert outcome.regime == "loop:lightning_loop(accumulate_grad_batches=4)"


def test_uneven_micro_batches_are_caught():
    """12 samples in K=5 micro-batches of 3,3,2,2,2: Lightning's mean / K over-weights the big ones."""
    (outcome,) = ec.check_loop("mlp", lightning_loop(Classifier, accumulate_grad_batches=5)).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0


def test_clipping_missing_from_the_reference_is_caught():
    """The clipping bites: the same configuration against unclipped full batch does not match."""
    loop = lightning_loop(Classifier, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    (outcome,) = ec.check_loop("mlp", loop).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0


def test_a_factory_that_is_not_a_lightning_module_is_named():
    with pytest.raises(ec.InvalidArgument, match=r"Expected a factory returning a LightningModule but got module="):
        ec.check_loop("mlp", lightning_loop(lambda model: model, accumulate_grad_batches=2))


# --- precision="bf16-mixed" on CPU: judged at the bf16 autocast mode's stated tolerance ----------------

BF16 = ec.PRECISIONS["bf16-autocast"]


def bf16_full_batch(model, optimizer, batches):
    """The float32 full-batch reference with its forward and loss under bf16 autocast, as Lightning's."""
    for inputs, targets in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def check_bf16(module, k):
    loop = lightning_loop(module, accumulate_grad_batches=k, precision="bf16-mixed")
    return ec.check_loop("mlp", loop, reference=bf16_full_batch, dtype=torch.float32, rtol=BF16.rtol, atol=BF16.atol)


def test_bf16_mixed_accumulation_is_equivalent_within_bf16_tolerance():
    check_bf16(Classifier, 4).assert_equivalent()


def test_bf16_mixed_with_the_loss_divided_by_k_again_is_caught():
    (outcome,) = check_bf16(lambda model: Classifier(model, divide_by=4), 4).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0
