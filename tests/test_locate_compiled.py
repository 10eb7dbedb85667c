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


@pytest.mark.full_only  # make test-full: two compiled checks (13 s); the rule's stand-in test below is in make test
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


def _runs_reading(*reads: float, step: int = 0):
    """A stand-in replay's runs: the reference's and the candidate's traces of ``step``, each reading ``w`` as given."""
    from equivcheck.result import RunResult
    from equivcheck.trace import StepTrace

    def run(read: float) -> RunResult:
        trace = StepTrace(step, 0, [], [], {}, {"w": torch.tensor([read], dtype=torch.float64)}, {}, [])
        return RunResult("c", "r", (None,), ({"w": torch.tensor([read], dtype=torch.float64)},), {}, {}, 0.0,
                         traces=(trace,))
    return tuple(run(read) for read in reads)


def _eager_twin_says(compiled_read: float, eager_read: float):
    """What the localizer says of a run whose recorded gradient (2.0) no compiled replay reproduces (they read
    ``compiled_read``) and whose eager twin reads ``eager_read``; the reference reads 1.0 throughout."""
    from equivcheck.judge import locate as localizer
    from equivcheck.judge.compare import compare

    reference, candidate = _runs_reading(1.0, 2.0)
    replays = {False: _runs_reading(1.0, compiled_read), True: _runs_reading(1.0, eager_read)}
    comparison = compare(reference, candidate, tolerance=ec.Tolerance(1e-7, 1e-7))
    walked = localizer.Replayed(comparison, reference, candidate,
                                 lambda steps, modules, eager: replays[bool(eager)], (0,))
    return walked.walk(0)


def test_the_compiler_is_named_only_where_the_eager_twin_computes_otherwise_than_the_compiled_replay():
    assert _eager_twin_says(compiled_read=3.0, eager_read=1.0).phase == "compiler"
    # replays that train otherwise than the run, compiled or not alike (state kept across runs): no compiler claim
    from equivcheck.judge import locate as localizer

    with pytest.raises(localizer.ReplayDiffers):
        _eager_twin_says(compiled_read=1.0, eager_read=1.0)


def test_a_step_that_sets_its_gradients_by_hand_is_traced_with_its_parameters_hooked_alone():
    """torch.func computes gradients no parameter hook sees and the step sets them itself: the replay with its
    parameters hooked alone (how a compiled step that module hooks change is replayed) still records what the
    optimizer read. Without it that replay would be held to the run with nothing to hold, and read nothing."""
    from equivcheck.regimes.local import FullBatch
    from equivcheck.runners.tracing import TraceComplete, tracing

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parameters = list(model.named_parameters())
    with pytest.raises(TraceComplete), \
            tracing(lambda: list(model.named_modules()), parameters, optimizer, FullBatch(), (0,), calls=False) as tracer:
        grads = torch.func.grad(lambda params: torch.func.functional_call(model, params, torch.ones(4, 3)).sum())(
            dict(parameters))
        for name, parameter in parameters:
            parameter.grad = grads[name]
        optimizer.step()
    (trace,) = tracer.traces
    assert sorted(trace.read) == ["bias", "weight"]
    assert torch.equal(trace.read["bias"], torch.full((2,), 4.0))


def _held_twin_says(eager_read: float):
    """What the eager twin adds to a location the run's compiled replay (held to the run: it reads the run's 2.0)
    found in code no module hook saw; the reference reads 1.0, the twin ``eager_read``."""
    from equivcheck.diff import Location
    from equivcheck.judge import locate as localizer
    from equivcheck.judge.compare import compare

    reference, candidate = _runs_reading(1.0, 2.0)
    replays = {False: _runs_reading(1.0, 2.0), True: _runs_reading(1.0, eager_read)}
    comparison = compare(reference, candidate, tolerance=ec.Tolerance(1e-7, 1e-7))
    walked = localizer.Replayed(comparison, reference, candidate,
                                 lambda steps, modules, eager: replays[bool(eager)], (0,))
    seen = Location(0, "forward", "", "the input of `1`", 5.0, "every module that ran before it computes alike")
    return walked._eager_twin(0, False, None, held=True, seen=seen)


def test_a_location_outside_every_module_is_the_compilers_where_the_eager_twin_reads_the_references_gradients():
    location = _held_twin_says(eager_read=1.0)
    assert location.phase == "compiler"
    assert "(its compiled replay first differs at the input of `1`)" in location.matched
    # an eager twin that reads what the compiled replay read: nothing compiled computes otherwise, nothing added
    assert _held_twin_says(eager_read=2.0) is None


MODULES = ["a.x", "a.y", "a", "b"]  # the eager twin's calls, children before their parents


def _narrowed(parts_when):
    """``_compiled_alone`` over stand-in replays: a replay reads the run's gradient (2.0, the reference's 1.0) where
    ``parts_when(compiled)`` holds of the modules it left compiled (every module not uncompiled, nor inside one)."""
    from equivcheck.judge import locate as localizer
    from equivcheck.judge.compare import compare
    from equivcheck.trace import ModuleCall, StepTrace

    reference, candidate = _runs_reading(1.0, 2.0)
    replayed = []

    def replay(steps, modules, eager):
        compiled = {name for name in MODULES if not any(name == off or name.startswith(f"{off}.") for off in eager)}
        replayed.append(eager)
        return _runs_reading(1.0, 2.0 if parts_when(compiled) else 1.0)

    comparison = compare(reference, candidate, tolerance=ec.Tolerance(1e-7, 1e-7))
    walked = localizer.Replayed(comparison, reference, candidate, replay, (0,))
    twin = StepTrace(0, 0, [ModuleCall(name, 0, [], []) for name in MODULES], [], {}, {}, {}, [])
    module, said = walked._compiled_alone(0, twin)
    return module, said, replayed


def test_the_compiler_is_narrowed_to_the_one_module_whose_compiled_form_alone_makes_the_run_part():
    module, said, replayed = _narrowed(lambda compiled: "a.y" in compiled)
    assert module == "a.y" and "`a.y`'s own code (its children uncompiled too) makes the run part" in said
    # the model's own code first (its children uncompiled), then each child alone: a; a's own code, then its
    # children alone: a.x, a.y, whose own code is a.y alone again (replayed once)
    assert replayed == [("a", "b"), ("b",), ("a.x", "a.y", "b"), ("a.y", "b"), ("a.x", "b")]
    module, said, _ = _narrowed(lambda compiled: True)  # the difference made between the modules
    assert module == "" and "the model's own code between its modules" in said
    module, said, _ = _narrowed(lambda compiled: {"a.x", "b"} <= compiled)  # two compiled together, neither alone
    assert module == "" and "it parts where several are compiled together" in said
    module, said, _ = _narrowed(lambda compiled: {"a.x", "a.y"} <= compiled)
    assert module == "a" and "`a` compiled alone makes the run part, and none of its children compiled alone" in said


class ComputesOtherwiseCompiled(torch.nn.Module):
    """A module whose compiled form computes otherwise than its eager one (a compiler's wrong kernel, in miniature)."""

    def forward(self, x):
        return x * 1.01 if torch.compiler.is_compiling() else x


def test_a_module_left_uncompiled_runs_its_eager_forward_inside_the_compiled_model():
    from equivcheck.runners.train import eager_twin

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), ComputesOtherwiseCompiled())
    inputs = torch.ones(2, 3)
    eager = model(inputs)
    torch._dynamo.reset()
    assert not torch.equal(torch.compile(model, backend="aot_eager")(inputs), eager)
    torch._dynamo.reset()
    with eager_twin(("1",), lambda: list(model.named_modules())):
        assert torch.equal(torch.compile(model, backend="aot_eager")(inputs), eager)
    assert "forward" not in vars(model[1])  # its class's forward again
