"""An Accelerate loop, written as a team writes it, gated by check_loop.

Accelerate needs no helper: the team's loop is the code under test. What it must look like: build the
``Accelerator`` inside the loop, ``prepare`` the model, optimizer and a DataLoader of the global
batches' samples in order, and step under ``accelerator.accumulate(model)``; ``accelerator.backward``
divides each micro-batch's mean by K, so the micro-batches must tile each global batch evenly.
"""

import pytest

pytest.importorskip("accelerate", reason="Accelerate is not installed: `make test-frameworks` installs it")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import equivcheck as ec  # noqa: E402
from equivcheck import Verdict  # noqa: E402
from framework_references import CLIP, clipped_full_batch  # noqa: E402


def accelerate_loop(k, micro_batch_size=None, clip=None, clip_every_micro_batch=False):
    """``gradient_accumulation_steps=k`` over micro-batches of ``micro_batch_size`` (default: global / k),
    clipping to ``clip`` on the sync steps (or, the bug, after every micro-batch's backward)."""
    def loop(model, optimizer, batches):
        AcceleratorState._reset_state(True)  # Accelerate keeps one state per process: one per check
        GradientState._reset_state()
        accelerator = Accelerator(gradient_accumulation_steps=k, cpu=True)
        samples = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        loader = DataLoader(samples, batch_size=micro_batch_size or len(batches[0][0]) // k)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(inputs), targets))
                if clip and (accelerator.sync_gradients or clip_every_micro_batch):
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()  # a no-op until the sync step: Accelerate's optimizer wrapper decides
                optimizer.zero_grad()
    return loop


@pytest.mark.parametrize("k", [3, 4])
def test_accumulate_is_equivalent_to_full_batch(k):
    ec.check_loop("mlp", accelerate_loop(k)).assert_equivalent()


def test_micro_batches_that_do_not_tile_the_global_batch_are_caught():
    """12 micro-batches of 3 with K=5: steps over 15, 15 and (the end-of-dataloader sync) 6 samples."""
    (outcome,) = ec.check_loop("mlp", accelerate_loop(5, micro_batch_size=3)).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0


def test_micro_batches_of_the_wrong_size_are_caught_as_a_step_count_problem():
    """Micro-batches of 3 with K=3: 9 samples per step, four steps over the 36 samples."""
    (outcome,) = ec.check_loop("mlp", accelerate_loop(3, micro_batch_size=3)).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert "optimizer steps: the reference took 3, the candidate 4" in outcome.comparison.problems


def test_clipping_on_sync_steps_is_equivalent_to_full_batch_clipped_the_same():
    ec.check_loop("mlp", accelerate_loop(4, clip=CLIP), reference=clipped_full_batch).assert_equivalent()


def test_clipping_every_micro_batch_is_caught():
    loop = accelerate_loop(4, clip=CLIP, clip_every_micro_batch=True)
    (outcome,) = ec.check_loop("mlp", loop, reference=clipped_full_batch).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0
