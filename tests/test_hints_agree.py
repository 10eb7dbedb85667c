"""A hint agrees with where the run parts or is not shown (issue 65): one that presumes an accumulation loop is
dropped for a step that called the model once, and kept for one that accumulated; the buffer hint names BatchNorm only
for a BatchNorm's statistics."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec


def _model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


CASE = ec.Case(name="hinted_mlp", model=_model, data=lambda: (torch.randn(24, 6), torch.randint(0, 3, (24,))),
               loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=12, steps=2)


def _clip_each(model):
    for parameter in model.parameters():  # every parameter clipped on its own: no one factor over them
        torch.nn.utils.clip_grad_norm_([parameter], 0.05)


def clips_each_parameter(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    _clip_each(model)
    optimizer.step()


def clips_each_micro_batch(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    for chunk, target in zip(inputs.chunk(3), targets.chunk(3)):
        (F.cross_entropy(model(chunk), target) / 3).backward()
        _clip_each(model)
    optimizer.step()


pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def test_a_hint_that_presumes_an_accumulation_loop_is_dropped_for_a_step_without_one():
    (outcome,) = ec.check_step(CASE, clips_each_parameter).outcomes
    location = outcome.location
    assert outcome.verdict is ec.Verdict.MISMATCH and location.forwards == 1, outcome.describe()
    assert "accumulation loop" not in outcome.describe(), outcome.describe()


def test_the_same_hint_is_kept_for_a_step_that_accumulates():
    (outcome,) = ec.check_step(CASE, clips_each_micro_batch).outcomes
    assert outcome.location.forwards == 3, outcome.describe()
    assert "inside the accumulation loop" in outcome.comparison.hint, outcome.describe()
