"""A compiled step is located (issue 65): where its replays with hooks leave modules unrecorded or train otherwise,
its eager twin (torch.compile off, from the same state) is replayed; one that trains as the run did is walked as any
eager run, one that trains as the reference did where the compiled code does not names the compiler."""

import weakref

import pytest
import torch
import torch.nn.functional as F

import equivcheck as ec

from test_locate_seen import CASE, ScaledTanh

COMPILED = weakref.WeakKeyDictionary()  # each run's compiled model, made at its first step


def _compiled(model, optimizer):
    if optimizer not in COMPILED:
        torch._dynamo.reset()
        COMPILED[optimizer] = torch.compile(model, backend="aot_eager")
    return COMPILED[optimizer]


def compiled_step(model, optimizer, batch):
    inputs, targets = batch
    optimizer.zero_grad()
    F.cross_entropy(_compiled(model, optimizer)(inputs), targets).backward()
    optimizer.step()


def compiled_step_with_another_activation(model, optimizer, batch):
    """The team's block 1 activation changed (1% off), the whole model compiled."""
    if not isinstance(model.blocks[1].act, ScaledTanh):
        model.blocks[1].act = ScaledTanh()
    compiled_step(model, optimizer, batch)


pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def test_a_compiled_model_with_a_changed_block_is_located_in_that_block():
    (outcome,) = ec.check_step(CASE, compiled_step_with_another_activation).outcomes
    location = outcome.location
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()
    assert ec.check_step(CASE, compiled_step).outcomes[0].verdict is ec.Verdict.EQUIVALENT  # the twin


def test_the_compiler_is_named_where_the_eager_twin_trains_as_the_reference_and_the_compiled_code_does_not():
    """pytorch/pytorch#117758 as the field reproduces it: a forward hook registered after the first compiled call,
    never run by the graph compiled without it. Replayed eagerly the hook runs and the run reads the reference's
    gradients: the compiled code is where it parts. With the hook dictionaries guarded it recompiles and holds."""
    from equivcheck.suites import field

    (module,) = [m for m in field.modules() if m.__name__.endswith(".pytorch_117758")]
    (outcome,) = module.buggy().outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module) == (1, "compiler", ""), outcome.describe()
    assert "its eager twin (torch.compile off, from the same state) reads the reference's gradients" in location.matched
    assert module.fixed().outcomes[0].verdict is ec.Verdict.EQUIVALENT
