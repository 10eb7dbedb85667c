"""Hints on a run that communicated over tp name tensor parallelism's own classes of bug, not accumulation's."""

import pytest
import torch

import equivcheck as ec
from equivcheck.result import RunResult

OVER_TP = ({"all_reduce[tp]": (1, 288)},)


def run(grads: dict[str, list[float]], loss=1.0, collectives=OVER_TP) -> RunResult:
    return RunResult(case="c", regime="r", losses=(loss,), grads=({n: torch.tensor(g) for n, g in grads.items()},),
                     weights={n: torch.tensor(g) for n, g in grads.items()}, buffers={}, seconds=0.0,
                     collectives=collectives)


REFERENCE = {"norm.weight": [0.5, -1.0], "fc1.weight": [2.0, 3.0], "fc2.weight": [1.0, -4.0]}


def hint(candidate: dict[str, list[float]], collectives=OVER_TP, loss=1.0) -> str:
    reference, candidate = run(REFERENCE), run(candidate, loss, collectives)
    return ec.diagnose(reference, candidate, ec.compare(reference, candidate)).hint


def test_a_replicated_parameters_gradient_averaged_over_tp_is_named_so():
    """SP norms' gradients all-reduced with a mean: exactly 1/2 on 2 TP ranks, the rest exact (it read 'a detach ...
    truncated BPTT')."""
    said = hint({**REFERENCE, "norm.weight": [0.25, -0.5]})
    assert "gradients of norm.weight are 0.5 x the reference's" in said and "averaged over the TP group" in said
    assert "truncated BPTT" not in said


def test_a_replicated_parameter_counted_tp_times_is_named_so():
    said = hint({**REFERENCE, "norm.weight": [1.0, -2.0]})
    assert "counted 2 times" in said and "row bias added on every TP rank" in said


def test_the_loss_over_the_tp_size_is_named_so():
    said = hint({n: [v / 2 for v in g] for n, g in REFERENCE.items()})
    assert "loss divided by the TP size" in said


def test_every_gradient_off_by_no_one_factor_on_a_mesh_names_the_loss_weighting_over_dp():
    said = hint({"norm.weight": [0.6, -1.0], "fc1.weight": [2.0, 3.3], "fc2.weight": [1.1, -4.0]})
    assert "loss weighting over the data-parallel shards" in said and "zero_grad" not in said


def test_without_tp_the_same_runs_keep_the_accumulation_hints():
    said = hint({**REFERENCE, "norm.weight": [0.25, -0.5]}, collectives=None)
    assert "truncated BPTT" in said


def test_another_shape_is_said_as_a_shard_read_back_never_as_gradients_that_match():
    said = hint({**REFERENCE, "fc1.weight": [2.0, 3.0, 1.0, 1.0]})
    assert "another shape than the reference's" in said and "give gather=" in said and "match" not in said


def test_a_step_0_loss_that_differs_on_a_mesh_names_a_term_added_on_every_tp_rank():
    """The row bias added before the reduce: the forward itself differs (it got the generic micro-batch hint)."""
    said = hint({n: [v * 1.3 for v in g] for n, g in REFERENCE.items()} | {"norm.weight": [0.6, -1.1]}, loss=1.4)
    assert "added on every TP rank before the reduce" in said and "micro-batch" not in said
