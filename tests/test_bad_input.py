"""Bad input: an error that names the argument, its value and what is allowed; nothing truncated."""

import dataclasses

import pytest
import torch
from torch import nn

import equivcheck as ec

MLP = ec.get_case("mlp")


def variant(**changes):
    return dataclasses.replace(MLP, **{"name": "variant", **changes})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("acumulate:chunks=4", "unknown regime 'acumulate'; known regimes: accumulate, data_parallel, ddp, "),
        ("accumulate:chunks=0", "chunks=0 is not allowed: expected an integer >= 1"),
        ("accumulate:chunks=-2", "chunks=-2 is not allowed"),
        ("accumulate:chunks=four", "Expected int but got chunks='four' (type=str)"),
        ("accumulate:chunks=2.5", "Expected int but got chunks='2.5' (type=str)"),
        ("accumulate", "accumulate needs chunks (e.g. 'accumulate:chunks=2')"),
        ("accumulate:chunk=2", "'chunk=2' is not allowed: accumulate takes chunks=..."),
        ("full_batch:chunks=2", "full_batch takes no parameters"),
    ],
)
def test_bad_regime_specs(spec, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.parse_regime(spec)
    assert message in str(raised.value)


def test_regime_spec_of_wrong_type():
    with pytest.raises(ec.InvalidArgument, match=r"Expected a regime spec str .* but got regime=4 \(type=int\)"):
        ec.parse_regime(4)


def test_chunks_larger_than_the_batch():
    with pytest.raises(ec.InvalidArgument, match=r"chunks=13 is not allowed: expected an integer from 1 to 12 "
                                                 r"\(the case's batch_size\)"):
        ec.run("mlp", "accumulate:chunks=13")


def test_missing_split_for_detached_partial():
    with pytest.raises(ec.InvalidArgument, match=r"split=None is not allowed: expected a function model -> \(trunk, head\)"):
        ec.run(variant(split=None), "detached_partial:chunks=2")


def test_check_rejects_bad_specs_before_running_anything():
    calls = []
    case = variant(model=lambda: calls.append(1) or MLP.model())
    with pytest.raises(ec.InvalidArgument, match="chunks=20"):
        ec.check(case, ["accumulate:chunks=2", "accumulate:chunks=20"])
    assert calls == []


def test_unknown_case_lists_the_known_ones():
    with pytest.raises(ec.InvalidArgument, match=r"unknown case 'mpl'; known cases: .*cnn.*, mlp,"):
        ec.run("mpl", "full_batch")


def test_unknown_regime_in_expect_mismatch():
    with pytest.raises(ec.InvalidArgument, match="unknown regime 'acumulate'"):
        ec.check(variant(expect_mismatch={"acumulate": "typo"}), ["full_batch"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data": lambda: (torch.zeros(0, 6), torch.zeros(0, dtype=torch.long))},
         "holds 0 samples: expected exactly steps * batch_size = 3 * 12 = 36"),
        ({"data": lambda: (torch.randn(30, 6), torch.randint(0, 3, (30,)))},
         "holds 30 samples: expected exactly steps * batch_size = 3 * 12 = 36 (nothing is truncated or padded)"),
        ({"data": lambda: (torch.randn(40, 6), torch.randint(0, 3, (40,)))}, "holds 40 samples"),
        ({"data": lambda: (torch.randn(36, 6), torch.randint(0, 3, (35,)))},
         "inputs hold 36 samples and targets 35: expected the same number on dim 0"),
        ({"data": lambda: [torch.randn(36, 6)]}, "Expected a factory returning a tuple (inputs, targets) of tensors"),
        ({"model": lambda: nn.Sequential(nn.Linear(6, 3)).requires_grad_(False)},
         "has no trainable parameters: expected at least one"),
        ({"model": lambda: "not a module"}, "Expected a factory returning a torch.nn.Module but got model='not a module'"),
        ({"loss": lambda out, target: nn.functional.cross_entropy(out, target)},
         "loss of case 'variant' returned shape () for 12 samples holding 12 items: expected a 1-D tensor of one loss per item"),
    ],
)
def test_bad_case_contents(changes, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.run(variant(**changes), "full_batch")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 is not allowed: expected an integer >= 1"),
        ({"batch_size": "12"}, "Expected int but got batch_size='12' (type=str)"),
        ({"steps": 1.5}, "Expected int but got steps=1.5 (type=float)"),
        ({"name": "has space"}, "name='has space' is not allowed"),
        ({"model": None}, "Expected a callable but got model=None"),
        ({"split": 3}, "Expected a callable but got split=3"),
        ({"rtol": 1e-3}, "rtol=0.001 is not allowed: expected rtol and atol given together"),
        ({"dtype": torch.float16}, "dtype=torch.float16 is not allowed"),
    ],
)
def test_bad_case_arguments(changes, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        variant(**changes)
    assert message in str(raised.value)


def test_cases_from_a_missing_file_or_module():
    with pytest.raises(ec.InvalidArgument, match="cases_from='no/such/file.py' is not allowed"):
        ec.load_cases_from("no/such/file.py")
    with pytest.raises(ec.InvalidArgument, match="cases_from='no_such_module_here'"):
        ec.load_cases_from("no_such_module_here")
