"""Steps that hand the optimizer a closure (``optimizer.step(closure)``): Lightning's automatic
optimisation, LBFGS, a team's own closure. The last forward and backward run inside ``step``; the
gradients equivcheck compares must be the ones the optimizer steps with, and the bugs must still show.
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck import Verdict

CHUNKS = 4  # 12 samples per step: micro-batches of 3


def micro_batch_loss(model, x, y, global_items):
    """The faithful micro-batch loss: its sum over the global batch's item count."""
    return F.cross_entropy(model(x), y, reduction="sum") / global_items


def closure_step(model, optimizer, batch, calls=None):
    """Full batch, the whole forward and backward inside the closure; each call is noted in ``calls``."""
    inputs, targets = batch

    def closure():
        if calls is not None:
            calls.append(1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    optimizer.zero_grad()
    return loss.detach()


def lightning_shaped_loop(scale=1.0, zero_grad_in_closure=False):
    """Accumulate CHUNKS micro-batches as Lightning's automatic optimisation does: the first CHUNKS - 1
    forward and backward outside, the last inside the closure given to ``optimizer.step``."""
    def loop(model, optimizer, batches):
        losses = []
        for inputs, targets in batches:
            pieces = list(zip(inputs.tensor_split(CHUNKS), targets.tensor_split(CHUNKS)))
            total = 0.0
            for x, y in pieces[:-1]:
                loss = micro_batch_loss(model, x, y, len(targets)) * scale
                loss.backward()
                total += loss.detach()

            def closure(x=pieces[-1][0], y=pieces[-1][1]):
                if zero_grad_in_closure:
                    optimizer.zero_grad()
                loss = micro_batch_loss(model, x, y, len(targets)) * scale
                loss.backward()
                return loss

            total += optimizer.step(closure=closure).detach()  # by keyword, as Lightning calls it
            optimizer.zero_grad()
            losses.append(total)
        return losses

    loop.__qualname__ = f"lightning_shaped{'_zero_grad_in_closure' if zero_grad_in_closure else ''}_x{scale:g}"
    return loop


def test_a_closure_step_is_equivalent_to_full_batch():
    ec.check_step("mlp", closure_step).assert_equivalent()


def test_the_closure_runs_once_per_step():
    calls = []
    ec.check_step("mlp", functools.partial(closure_step, calls=calls)).assert_equivalent()
    assert len(calls) == 3  # one per optimizer step: never re-run to record, never a doubled gradient


def test_a_lightning_shaped_loop_is_equivalent_to_full_batch():
    ec.check_loop("mlp", lightning_shaped_loop()).assert_equivalent()


def test_a_closure_loop_that_divides_by_k_again_is_caught():
    (outcome,) = ec.check_loop("mlp", lightning_shaped_loop(scale=1 / CHUNKS)).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0


def test_zero_grad_inside_the_closure_is_caught():
    (outcome,) = ec.check_loop("mlp", lightning_shaped_loop(zero_grad_in_closure=True)).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0


# --- LBFGS: the closure is evaluated again within one step -------------------------------------------

def lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=3)


LBFGS_MLP = dataclasses.replace(ec.get_case("mlp"), name="mlp_lbfgs", optimizer=lbfgs)


def lbfgs_step(scale=1.0):
    """Every evaluation zeroes the gradients and accumulates CHUNKS micro-batches, as LBFGS requires."""
    def step(model, optimizer, batch):
        inputs, targets = batch

        def closure():
            optimizer.zero_grad()
            total = 0.0
            for x, y in zip(inputs.tensor_split(CHUNKS), targets.tensor_split(CHUNKS)):
                loss = micro_batch_loss(model, x, y, len(targets)) * scale
                loss.backward()
                total += loss.detach()
            return total

        return optimizer.step(closure)

    step.__qualname__ = f"lbfgs_accumulated_x{scale:g}"
    return step


def test_lbfgs_accumulating_in_its_closure_is_equivalent_to_its_full_batch_closure():
    """What is recorded is the gradient LBFGS first sees; its later evaluations run for real."""
    ec.check_step(LBFGS_MLP, lbfgs_step(), reference=closure_step).assert_equivalent()


def test_lbfgs_with_a_loss_divided_by_k_again_is_caught():
    (outcome,) = ec.check_step(LBFGS_MLP, lbfgs_step(scale=1 / CHUNKS), reference=closure_step).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 0

