"""Bad input: an error that names the argument, its value and what is allowed; nothing truncated."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import equivcheck as ec

MLP = ec.get_case("mlp")


def variant(**changes):
    return dataclasses.replace(MLP, **{"name": "variant", **changes})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("acumulate:chunks=4", "unknown regime 'acumulate'; known regimes: accumulate, accumulate_divided_twice, checkpoint, checkpoint_reentrant, checkpoint_without_rng_state, clip_per_micro_batch, cp"),  # test modules may register more
        ("accumulate:chunks=0", "chunks=0 is not allowed: expected an integer >= 1"),
        ("accumulate:chunks=-2", "chunks=-2 is not allowed"),
        ("accumulate:chunks=four", "Expected int but got chunks='four' (type=str)"),
        ("accumulate:chunks=2.5", "Expected int but got chunks='2.5' (type=str)"),
        ("accumulate", "accumulate needs chunks (e.g. 'accumulate:chunks=2')"),
        # One rank shards nothing: a DDP check that defaulted to it would pass whatever the step does.
        ("ddp:backend=gloo", "ddp needs world_size (e.g. 'ddp:world_size=2')"),
        ("ddp_no_sync:chunks=3", "ddp_no_sync needs world_size (e.g. 'ddp_no_sync:world_size=2')"),
        ("fsdp_no_sync:chunks=3", "fsdp_no_sync needs world_size"),
        ("accumulate:chunk=2", "'chunk=2' is not allowed: accumulate takes chunks=..."),
        ("full_batch:chunks=2", "full_batch takes max_norm=..."),
            ("sample_by_sample:chunks=2", "sample_by_sample takes no parameters"),
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
        ({"scheduler": lambda optimizer: 0.5}, "returned 0.5 (type=float): expected a learning-rate scheduler with "
                                               "step(), state_dict() and load_state_dict()"),
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
        ({"scheduler": "linear"}, "Expected a callable but got scheduler='linear'"),
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


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"regimes": []}, "regimes=[] is not allowed: expected at least one regime spec"),
        ({"regimes": ()}, "regimes=() is not allowed: expected at least one regime spec"),
        ({"regimes": [4]}, "Expected a regime spec str such as 'accumulate:chunks=4' but got regime=4 (type=int)"),
        ({"regimes": ["accumulate:chunks=2,chunks=3"]}, "chunks is given twice: expected each parameter once"),
        ({"seed": -1}, "seed=-1 is not allowed: expected an integer from 0 to 4294967295"),
        ({"seed": "a"}, "Expected int but got seed='a' (type=str)"),
        ({"seed": 2**70}, "seed=1180591620717411303424 is not allowed: expected an integer from 0 to 4294967295"),
        ({"seed": 1.5}, "Expected int but got seed=1.5 (type=float)"),
        ({"seed": True}, "Expected int but got seed=True (type=bool)"),
        ({"timeout": INF}, "timeout=inf is not allowed: expected a finite number > 0 and <= 86400"),
        ({"timeout": NAN}, "timeout=nan is not allowed: expected a finite number > 0"),
        ({"timeout": 0}, "timeout=0 is not allowed: expected a finite number > 0"),
        ({"timeout": -1}, "timeout=-1 is not allowed"),
        ({"timeout": "60"}, "Expected a number > 0 and <= 86400 but got timeout='60' (type=str)"),
        ({"rtol": INF, "atol": INF}, "rtol=inf is not allowed: expected a finite number >= 0 and <= 1"),
        ({"rtol": NAN, "atol": 1e-7}, "rtol=nan is not allowed"),
        ({"rtol": 1e-7, "atol": -1}, "atol=-1 is not allowed"),
        ({"rtol": "1e-3", "atol": 1e-3}, "Expected a number >= 0 and <= 1 but got rtol='1e-3' (type=str)"),
        ({"rtol": 0, "atol": 0}, "atol=0 is not allowed: expected rtol or atol above 0"),
        ({"atol": 1e-3}, "atol=0.001 is not allowed: expected rtol and atol given together"),
        ({"dtype": "float16"}, "unknown dtype 'float16'; known dtypes: bf16, bf16-autocast, bf16-master, float32, float64"),
        ({"dtype": torch.int64}, "dtype=torch.int64 is not allowed"),
        ({"reference": "bogus"}, "unknown regime 'bogus'"),
        ({"backend": "mpi", "regimes": ["ddp:world_size=2"]}, "backend='mpi' is not allowed"),
    ],
)
def test_check_refuses_bad_arguments_before_running_anything(options, message):
    calls = []
    case = variant(model=lambda: calls.append(1) or MLP.model())
    options = {"regimes": ["accumulate:chunks=2"], **options}
    with pytest.raises(ec.InvalidArgument) as raised:
        ec.check(case, options.pop("regimes"), **options)
    assert message in str(raised.value)
    assert calls == []


def test_one_spec_given_where_a_list_is_expected_is_checked_as_that_spec():
    report = ec.check("mlp", "accumulate:chunks=4")
    assert [(o.regime, o.verdict) for o in report.outcomes] == [("accumulate:chunks=4", ec.Verdict.EQUIVALENT)]


def a_step(model, optimizer, batch):
    """A step importable by name, so that only the argument under test is wrong."""


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ec.run("mlp", "full_batch", seed=-1), "seed=-1 is not allowed"),
        (lambda: ec.run("mlp", "ddp:world_size=2", timeout=INF), "timeout=inf is not allowed"),
        (lambda: ec.run(3, "full_batch"), "Expected an equivcheck.Case or a registered case name but got case=3"),
        (lambda: ec.check_step("mlp", None), "Expected a callable but got step=None"),
        (lambda: ec.check_step("mlp", lambda m, o, b: None, world_size=2),
         "expected a function, or an object bound to a name, at the top level of an importable module"),
        (lambda: ec.check_step("mlp", a_step, wrap=a_step), "is not allowed without world_size: expected world_size="),
        (lambda: ec.check_step("mlp", a_step, world_size=2, wrap=3), "Expected a callable but got wrap=3"),
        (lambda: ec.check_step("mlp", a_step, world_size=2, wrap=lambda m: m),
         "at the top level of an importable module or of the script being run (worker processes import the wrap"),
        (lambda: ec.check_loop("mlp", "not a loop"), "Expected a callable but got loop='not a loop'"),
        (lambda: ec.check_step("mlp", lambda m, o, b: None, seed=-1), "seed=-1 is not allowed"),
    ],
)
def test_every_public_entry_names_the_bad_argument(call, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        call()
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": nn.Linear(6, 3)}, "model=Linear(in_features=6, out_features=3, bias=True) is not allowed: expected "
                                     "a factory that builds the model, such as model=lambda: Linear(...)"),
        ({"data": (torch.randn(36, 6), torch.randint(0, 3, (36,)))}, "Expected a callable but got data=(tensor("),
        ({"rtol": INF, "atol": 1e-7}, "rtol=inf is not allowed: expected a finite number >= 0 and <= 1"),
        ({"rtol": 1e-7, "atol": -1.0}, "atol=-1.0 is not allowed"),
        ({"expect_mismatch": ["accumulate"]}, "Expected a mapping of regime -> reason but got expect_mismatch=['accumulate']"),
        ({"steps": 0}, "steps=0 is not allowed: expected an integer >= 1"),
        ({"batch_size": True}, "Expected int but got batch_size=True (type=bool)"),
    ],
)
def test_bad_case_fields(changes, message):
    with pytest.raises(ec.InvalidArgument) as raised:
        variant(**changes)
    assert message in str(raised.value)


def poisoned_loss(out, target):
    """Cross entropy that turns into NaN: a loss that diverged, or a log of zero."""
    return nn.functional.cross_entropy(out, target, reduction="none") * float("nan")


def test_a_non_finite_loss_is_an_error_not_a_reference_that_disagrees_with_itself():
    (outcome,) = ec.check(variant(loss=poisoned_loss), ["accumulate:chunks=2"]).outcomes
    assert outcome.verdict is ec.Verdict.ERROR
    assert "the reference full_batch failed: NonFinite: non-finite loss (nan) at step 0 under full_batch" in outcome.reason


def exploding_step(model, optimizer, batch):
    inputs, targets = batch
    nn.functional.cross_entropy(model(inputs), targets).backward()
    model[0].weight.grad[0, 0] = float("inf")  # an overflow in the team's own step
    optimizer.step()
    optimizer.zero_grad()


def test_a_non_finite_gradient_names_the_parameter_and_the_step():
    (outcome,) = ec.check_step("mlp", exploding_step).outcomes
    assert outcome.verdict is ec.Verdict.ERROR
    assert "non-finite gradient of '0.weight' at step 0 under step:exploding_step" in outcome.reason


IN_PROCESS = sorted(name for name, cls in ec.REGIMES.items() if not cls.distributed and name not in ("step", "loop"))
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=8), st.lists(st.integers(), max_size=2))
spec_texts = st.one_of(
    st.text(max_size=30),
    st.builds(lambda name, params: f"{name}:{params}", st.sampled_from(IN_PROCESS + ["acumulate", ""]),
              st.lists(st.tuples(st.sampled_from(["chunks", "max_norm", "detach", "chunk", ""]),
                                 st.sampled_from(["0", "1", "2", "5", "-1", "x", "1.5", "", "1e9"])), max_size=3)
              .map(lambda pairs: ",".join(f"{k}={v}" for k, v in pairs))),
)


@given(regimes=st.one_of(spec_texts, st.lists(spec_texts, max_size=3), junk),
       seed=st.one_of(st.just(0), junk), timeout=st.one_of(st.just(60), junk),
       tolerance=st.one_of(st.just((None, None)), st.tuples(junk, junk)),
       dtype=st.one_of(st.none(), st.sampled_from(["float32", "float16", "bf16-autocast"]), junk))
@settings(max_examples=150)
def test_malformed_arguments_give_a_named_error_or_a_verdict_never_another_exception(regimes, seed, timeout,
                                                                                     tolerance, dtype):
    rtol, atol = tolerance
    try:
        report = ec.check("seed004_linear", regimes, seed=seed, timeout=timeout, rtol=rtol, atol=atol, dtype=dtype,
                          measure_memory=False)
    except ec.InvalidArgument as error:
        assert str(error)
    else:
        assert report.outcomes and all(isinstance(o.verdict, ec.Verdict) for o in report.outcomes)


@given(changes=st.dictionaries(st.sampled_from(["name", "batch_size", "steps", "model", "data", "loss", "optimizer",
                                                "split", "dtype", "rtol", "atol", "expect_mismatch", "items"]),
                               junk, max_size=3))
@settings(max_examples=100)
def test_malformed_case_fields_give_a_named_error(changes):
    try:
        case = variant(**changes)
    except ec.InvalidArgument as error:
        assert str(error)
        return
    try:
        ec.check(case, ["accumulate:chunks=2"], measure_memory=False)
    except ec.InvalidArgument as error:
        assert str(error)


def test_a_bool_option_and_a_regime_defined_in_main_are_refused_with_the_way_out():
    with pytest.raises(ec.InvalidArgument) as refused:
        ec.parse_regime("ddp:world_size=2,static_graph=yes")
    assert str(refused.value) == "static_graph='yes' is not allowed: expected one of 0, 1, true, false"
    in_main = type("InMain", (type(ec.parse_regime("ddp:world_size=2")),), {"__module__": "__main__"})
    with pytest.raises(ec.InvalidArgument) as refused:
        ec.regimes.regime_source(in_main(world_size=2))
    assert str(refused.value) == (
        "regime 'ddp:world_size=2' is not allowed here: worker processes import the module that defines a regime, "
        "so distributed checks need a regime class defined in an importable module, not in __main__")
