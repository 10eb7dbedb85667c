"""Evidence below the verdict's tolerance (issue 65): a float64 run a hair off at step 0 that first fails the verdict
steps later is located where it parts, at float64's noise floor, saying both; the verdict keeps its tolerance, and a
check at another precision has no such floor."""


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.judge.compare import compare
from equivcheck.judge import noise_floor
from equivcheck.precision import Tolerance
from equivcheck.result import RunResult

from test_locate_seen import Net, full_batch


class TanhAHairOff(nn.Module):
    """The team's activation: tanh, 3e-8 relative too large (an approximation that parts from the exact function
    by far less than a float64 check's 1e-7)."""

    def forward(self, x):
        return torch.tanh(x) * (1 + 3e-8)


def swaps_in_the_approximation(model, optimizer, batch):
    if not isinstance(model.blocks[1].act, TanhAHairOff):
        model.blocks[1].act = TanhAHairOff()
    full_batch(model, optimizer, batch)


# A large learning rate: the difference grows step by step until it fails the verdict (at step 3's gradients)
CASE = ec.Case(name="hair_off", model=Net, data=lambda: (torch.randn(72, 6), torch.randint(0, 3, (72,))),
               loss=lambda out, target: F.cross_entropy(out, target, reduction="none"), batch_size=12, steps=6,
               optimizer=lambda parameters: torch.optim.SGD(parameters, lr=3.0))


pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def test_a_difference_under_the_tolerance_is_located_where_it_begins_and_says_where_it_fails():
    (outcome,) = ec.check_step(CASE, swaps_in_the_approximation).outcomes
    location = outcome.location
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert min(m.first_step for m in outcome.comparison.mismatches if m.kind == "grad") == 3  # the verdict's own
    assert (location.step, location.phase, location.module) == (0, "forward", "blocks.1.act"), outcome.describe()
    assert location.below_tolerance and "under the verdict's tolerance (rtol=1e-07, atol=1e-07)" in location.matched
    assert "it first fails the verdict at step 2, optimizer" in location.matched
    assert not outcome.comparison.hint  # the hints read what fails the verdict, steps later
    assert ec.check_step(CASE, full_batch).outcomes[0].verdict is ec.Verdict.EQUIVALENT  # the twin


def _run(grads: list[dict[str, torch.Tensor]], precision: str = "") -> RunResult:
    return RunResult("c", "r", (None,) * len(grads), tuple(grads), {}, {}, 0.0, precision=precision)


def test_the_floor_is_float64s_own_and_widens_to_the_references_repeat():
    reference = _run([{"w": torch.ones(3, dtype=torch.float64)}])
    failed = compare(reference, _run([{"w": torch.full((3,), 2.0, dtype=torch.float64)}]),
                     tolerance=Tolerance(1e-7, 1e-7))
    floor = noise_floor.floor_of(failed, reference, repeat_apart=0.0)
    assert floor.rtol == floor.atol == noise_floor.ULPS * torch.finfo(torch.float64).eps
    assert noise_floor.floor_of(failed, reference, repeat_apart=1e-12).atol == pytest.approx(1e-11)
    assert noise_floor.floor_of(failed, reference, repeat_apart=1e-6) is None  # no floor under the verdict's own


def test_no_floor_at_another_precision_or_a_lossy_regimes_widened_tolerance():
    low = _run([{"w": torch.ones(3)}], precision="float32")
    failed = compare(low, _run([{"w": torch.full((3,), 2.0)}]), tolerance=Tolerance(1e-5, 1e-5))
    assert noise_floor.floor_of(failed, low, 0.0) is None
    reference = _run([{"w": torch.ones(3, dtype=torch.float64)}])
    lossy = compare(reference, _run([{"w": torch.full((3,), 2.0, dtype=torch.float64)}]),
                    tolerance=Tolerance(1e-7, 1e-7).widened(1e-3, 1e-3, "a compressing comm hook's bound"))
    assert noise_floor.floor_of(lossy, reference, 0.0) is None


def test_the_first_step_apart_at_the_floor_is_before_the_verdicts():
    reference = _run([{"w": torch.ones(3, dtype=torch.float64)}] * 3)
    candidate = _run([{"w": torch.ones(3, dtype=torch.float64)},
                      {"w": torch.ones(3, dtype=torch.float64) * (1 + 1e-10)},
                      {"w": torch.ones(3, dtype=torch.float64) * 2}])
    floor = Tolerance(2.2e-13, 2.2e-13)
    assert noise_floor.first_step_apart(reference, candidate, floor, before=2) == 1
    assert noise_floor.first_step_apart(reference, candidate, floor, before=1) is None
