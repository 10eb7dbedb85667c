"""Checking a case: run the reference twice, every regime once, and turn comparisons into verdicts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from .case import Case
from .device import DEFAULT_DEVICE, HOST, NONDETERMINISTIC_KERNELS, device_for, is_nondeterministic_kernel
from .device import missing as missing_device
from .diff import Comparison, Problem, ProblemKind
from .judge.compare import Expected, compare, tolerance_of
from .measure.activation import TRANSFORMS_REFUSE_HOOKS
from .errors import (InvalidArgument, PrecisionWarning, Unavailable, WorkerError, expect_int, expect_seed,
                     expect_timeout, warn)
from .runners.anchors import release as release_anchors
from .runners.ranks import launcher, pool
from .runners.isolation import IsolatedRunner
from .process.kernels import decisions
from .process import threads as intra_op
from .runners.dispatch import DEFAULT_TIMEOUT, Started, start_request
from .runners.request import RunRequest
from .judge import rounding, witness
from .judge.hints import agreeing
from .judge import locate as localizer
from .precision import PRECISIONS, Precision, Tolerance, resolve_precision
from .regimes import DEFAULT_REGIMES, REGIMES, Regime, parse_regime
from .registry import all_cases, resolve_case
from .result import RunResult
from .judge.verdict import Outcome, Report, Verdict, expected_mismatch, judge
from .runners.train import initial_weights
from .process.seeding import DEFAULT_SEED, default_dtype, seeded


def regimes_for(case: Case) -> tuple[str, ...]:
    """The specs a case is checked under by default: its own list, else the defaults that apply."""
    if case.regimes is not None:
        return case.regimes
    return tuple(s for s in DEFAULT_REGIMES if case.split is not None or not parse_regime(s).needs_split)


def check(
    case: Case | str,
    regimes: Iterable[str | Regime] | None = None,
    *,
    reference: str | Regime = "full_batch",
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = DEFAULT_SEED,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    dtype: str | torch.dtype | Precision | None = None,
    measure_memory: bool = True,
    threads: int | None = None,
    compare_losses: bool = True,
    isolate: bool = False,
    device: str | torch.device | None = None,
    locate: bool | None = None,
) -> Report:
    """Check ``case`` under each regime against ``reference`` (run twice, to prove it deterministic).

    ``backend`` (gloo or nccl) applies to distributed regimes whose spec leaves it at auto;
    ``timeout``: the seconds each distributed job, and each run in the isolating child, may go without progress (a
    step taken, a graph compiled) before it is a hang. ``dtype`` picks the
    precision mode (``'float64'``, ``'float32'``, ``'bf16-autocast'``, ``'fp16-autocast'``; default: the case's
    dtype); a mode this machine cannot run is skipped. ``measure_memory=False`` skips the peak
    activation memory (saved-tensor hooks: about a fifth of a tiny check's time). ``threads``: intra-op
    threads per run (default: one, unless ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` chose).
    ``compare_losses=False`` compares gradients and weights only: for code that reports a logged loss.
    ``isolate=True`` trains the in-process runs in a forked child, so that a run that kills its process (a
    kernel's SIGILL, a segfault) is an ``error`` verdict and the check goes on (isolation.py; about 25 ms a
    check); by default they train here, as the command and the pytest plugin do only when asked. ``device``:
    where every run trains (``'cpu'``, the default, or ``'cuda'``: equivcheck.device), the reference, its
    repeat, the witness and the float64 shadows included; ranks take a GPU each where there are enough, else
    train over gloo on the CPU, the verdict saying so. Without CUDA, ``device='cuda'`` skips every check.
    ``locate``: a failed check says where its run parts (judge/locate/: its first step that parts replayed with
    module hooks; default :data:`LOCATE_BY_DEFAULT`, on); ``False`` spares the replays where the verdict is all a
    caller reads.
    """
    return Report(tuple(iter_outcomes(plan(case, regimes, reference=reference, rtol=rtol, atol=atol, seed=seed,
                                          backend=backend, timeout=timeout, dtype=dtype, threads=threads,
                                          compare_losses=compare_losses, isolate=isolate, device=device,
                                          locate=locate),
                                     measure_memory=measure_memory)))


# Whether a failed check says where its run parts, where the call leaves ``locate`` out. The replays cost up to a
# training of the steps up to the one that parts: a test session that asserts verdicts alone may turn it off.
LOCATE_BY_DEFAULT = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """One case's checks, validated: nothing trains until every argument is known to be usable."""

    case: Case
    specs: tuple[Regime, ...]
    reference: Regime
    precision: Precision
    rtol: float | None
    atol: float | None
    seed: int
    timeout: float
    threads: int | None = None  # intra-op threads per run (None: one, unless the user chose; process/threads.py)
    compare_losses: bool = True  # False: gradients and weights only (a step that returns a logged loss)
    tolerance_given: bool = False  # rtol and atol came from the call: they hold for every regime, a lossy one too
    isolate: bool = False  # in-process runs train in a forked child (isolation.py)
    misfits: tuple[tuple[str, str], ...] = ()  # (spec, why) asked for with other cases, that cannot run this one
    device: str = DEFAULT_DEVICE  # where every run trains (equivcheck.device)
    # a large model may train on torch's own thread count: decided once, so every run of the check takes the same
    wide_threads: int = 1
    locate: bool = True  # a failed outcome says where its run parts (judge/locate/)
    runner: IsolatedRunner | None = dataclasses.field(default=None, compare=False, repr=False)  # while it runs

    def tolerance(self, spec: Regime, loss_precision: Precision | None = None) -> Tolerance:
        """What ``spec`` is compared at: the call's tolerance, else the regime's own bound where it is lossy
        (widening the case's or the precision's), else the case's or the precision's: the precision the loss was
        computed in, where that is lower than the case's (``loss_precision``) and the case sets no tolerance."""
        base = Tolerance.resolve(loss_precision or self.precision, self.rtol, self.atol)
        if self.tolerance_given:
            return base
        return spec.tolerance_for(self.case, self.precision, base) or base

    def run(self, spec: Regime, dtype: Precision, measure_memory: bool, order: str = "given",
            against: Expected | None = None, trace_steps: tuple[int, ...] = (),
            trace_modules: bool = True, anchor_to: str = "", trace_eager: bool | tuple[str, ...] = False) -> RunResult:
        """One run of this plan's case under ``spec``, with the plan's seed, timeout and threads; its samples in
        ``order`` (a witness: witness.py); compared as it trains where ``against`` says with what (compare.py); a
        replay that traces ``trace_steps`` (its modules' calls too, where ``trace_modules``; uncompiled, or those
        modules of it, where ``trace_eager``) and stops after them (runners/tracing.py); saving the state each step
        starts from to ``anchor_to`` (runners/anchors.py)."""
        return self.start(spec, dtype, measure_memory, order, against, trace_steps, trace_modules, anchor_to,
                          trace_eager).result()

    def start(self, spec: Regime, dtype: Precision, measure_memory: bool, order: str = "given",
              against: Expected | None = None, trace_steps: tuple[int, ...] = (),
              trace_modules: bool = True, anchor_to: str = "", trace_eager: bool | tuple[str, ...] = False) -> Started:
        """That run begun (on its ranks, for a distributed regime); an error starting it is read with its result."""
        # Every argument was checked when the plan was made: the request is trusted from here to the ranks.
        request = RunRequest(self.case, spec, resolve_precision(dtype), self.seed, measure_memory,
                             intra_op.resolve(self.threads), order, self.device,
                             wide_threads=self.wide_threads, trace_steps=trace_steps, trace_modules=trace_modules,
                             trace_eager=trace_eager, anchor_to=anchor_to)
        try:
            started = start_request(request, timeout=self.timeout, runner=self.runner, against=against)
        except Exception as error:
            return Started.failed(error)
        if self.compare_losses:
            return started
        return Started(lambda: _without_losses(started.result()), started.abandon)


def _without_losses(result: RunResult) -> RunResult:
    return dataclasses.replace(result, losses=(None,) * len(result.losses))


def plan(case: Case | str, regimes: Iterable[str | Regime] | str | Regime | None = None, *,
         reference: str | Regime = "full_batch", rtol: float | None = None, atol: float | None = None,
         seed: int = DEFAULT_SEED, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
         dtype: str | torch.dtype | Precision | None = None, threads: int | None = None,
         compare_losses: bool = True, isolate: bool = False, device: str | torch.device | None = None,
         locate: bool | None = None) -> Plan:
    """Validate a check's arguments; every usage error surfaces here, before anything runs."""
    case = resolve_case(case)
    if isinstance(regimes, (str, Regime)):  # one spec where a list was expected: checked as that one spec
        regimes = [regimes]
    if regimes is not None and not isinstance(regimes, Iterable):
        raise InvalidArgument.type("regimes", regimes, "a list of regime specs (or None: the case's own list)")
    chosen = regimes_for(case) if regimes is None else tuple(regimes)
    if not chosen:
        raise InvalidArgument.value("regimes", regimes, "at least one regime spec (None: the case's own list)")
    specs = tuple(with_backend(parse_regime(r), backend) for r in chosen)
    reference = parse_regime(reference)
    precision = resolve_precision(dtype, default=case.dtype)
    device = device_for(device, precision.default_device)
    _validate(case, [reference, *specs])
    Tolerance.resolve(precision, rtol, atol)
    expect_seed(seed)
    expect_timeout(timeout)
    if threads is not None:
        expect_int("threads", threads)
    locate = LOCATE_BY_DEFAULT if locate is None else locate
    for name, flag in (("compare_losses", compare_losses), ("isolate", isolate), ("locate", locate)):
        if not isinstance(flag, bool):
            raise InvalidArgument.type(name, flag, "bool")
    given = rtol is not None
    rtol, atol = (case.rtol, case.atol) if rtol is None and atol is None else (rtol, atol)
    return Plan(case, specs, reference, precision, rtol, atol, seed, timeout, threads, compare_losses, given, isolate,
                device=device, wide_threads=intra_op.wide(threads), locate=locate)


def iter_outcomes(plan: Plan, *, measure_memory: bool = True, runner: IsolatedRunner | None = None) -> Iterator[Outcome]:
    """Run a planned check and yield each outcome as soon as it is known (the CLI keeps those done
    when it is interrupted). A run that raises, or kills its process, is an ``error`` verdict, not the end of
    the report. ``runner``: the forked child of several plans (:func:`isolated`); by default an isolated plan
    forks its own."""
    case, precision = plan.case, plan.precision
    pool.remove_orphaned_folders_once()  # what checks killed with their ranks left in the temporary folder
    yield from (Outcome(case.name, spec, Verdict.SKIPPED, reason=f"does not fit this case: {why}")
                for spec, why in plan.misfits)
    if not plan.specs:
        return
    moved = tuple(spec for spec in plan.specs if _trains_on_cpu_instead(spec, plan.device))
    if moved:  # those rows train on the CPU, their reference too: another device draws and rounds otherwise
        kept = tuple(spec for spec in plan.specs if spec not in moved)
        for part in (dataclasses.replace(plan, specs=kept, misfits=()),
                     dataclasses.replace(plan, specs=moved, misfits=(), device="cpu")):
            for outcome in iter_outcomes(part, measure_memory=measure_memory, runner=runner) if part.specs else ():
                placed = _placement_note(plan, outcome.regime) if part.device != plan.device else ""
                yield dataclasses.replace(outcome, reason="; ".join(filter(None, (outcome.reason, placed))))
        return
    missing = precision.unavailable(plan.device)
    if missing is None and case.cpu_generator_only and plan.device != "cpu":
        missing = (f"{case.name}: {case.cpu_generator_only}; device={plan.device!r}, whose generator draws each "
                   "launch's numbers by its own shape")
    if missing is None:
        try:
            precision, note = _with_kernels(precision, plan.device, runner)
        except Unavailable as why:
            missing = str(why)
    if missing:
        yield from (Outcome(case.name, str(s), Verdict.SKIPPED, reason=missing) for s in plan.specs)
        return

    own_runner = runner is None and plan.isolate
    if own_runner:
        runner = isolated([plan])
    plan = dataclasses.replace(plan, runner=runner if plan.isolate else None)
    # The first distributed run trains on its ranks while the reference runs here: one job in flight at a time. Not
    # where runs are compared with the reference as they train (judged from the model's size before the reference
    # exists): that one could only come back recorded whole.
    recording = functools.cache(lambda: _recording_bytes(plan, precision) or 0)  # a skeleton built once, if asked
    streams = any(spec.distributed for spec in plan.specs) and recording() >= COMPARE_AS_IT_TRAINS_FROM
    ahead = {} if streams else _ahead(plan, -1, precision, measure_memory, lambda spec: None)
    anchors = tempfile.TemporaryDirectory(prefix="equivcheck-anchors-") if _anchors_each_step(
        plan, precision, recording) else contextlib.nullcontext("")
    try:
        with anchors as folder:
            try:
                for outcome in _outcomes(plan, precision, measure_memory, ahead, streams, folder):
                    yield dataclasses.replace(outcome, reason="; ".join(filter(None, (outcome.reason, note))))
            finally:
                release_anchors(folder)  # what the reference held in its GPU's memory
    finally:  # a consumer that stops early (Ctrl-C in the CLI) leaves no job unread on a pool, and no child
        for started in ahead.values():
            started.abandon()
        if own_runner:
            runner.close()


def _anchors_each_step(plan: Plan, precision: Precision, recording: Callable[[], int]) -> bool:
    """Whether a large check (``recording()``: the reference's bytes) in a lower precision judges its in-process
    regimes step by step from the reference's own state (runners/anchors.py), where free-running runs part by
    compounding rounding that only float64 shadows could tell from a fault. float64 checks, small ones and a
    GradScaler's stay free-running: cheap, or exact."""
    return (precision.dtype != torch.float64 and not precision.grad_scaler and plan.reference.anchorable
            and any(spec.anchorable and spec != plan.reference for spec in plan.specs)
            and recording() >= ANCHOR_STEPS_FROM)


# What an anchored verdict says: which judgement decided it.
ANCHORED = ("judged step by step from the reference's state: each step's gradients from the weights and optimizer "
            "state the reference began it with, each update against the reference's own step, or where it parts "
            "from it, against the reference's optimizer applied to this run's gradients (no float64 shadow trained)")


def _trains_on_cpu_instead(spec: Regime, device: str) -> bool:
    """Whether the ranks of ``spec`` cannot train on ``device`` (too few GPUs for nccl, a pipeline): equivcheck.device's
    rule then puts them on the CPU over gloo, and the row with them. Not where the device is missing altogether: the
    whole check is skipped there, naming it."""
    placed = spec.placement(device)
    return device != "cpu" and missing_device(device) is None and placed is not None and not placed.on_gpus


def _placement_note(plan: Plan, spec: str) -> str:
    """Why the row of ``spec`` trained on the CPU, though the check named another device."""
    regime = next((s for s in plan.specs if str(s) == spec), None)
    placed = None if regime is None else regime.placement(plan.device)
    return f"{placed.note}; the row's reference trains there too" if placed is not None and placed.note else ""


def _with_kernels(precision: Precision, device: str, runner: IsolatedRunner | None) -> tuple[Precision, str]:
    """``precision`` on the kernel path this process can run (probed before its first run: kernels.py), and the
    note every outcome then carries where that is not the default path. A path that set oneDNN's variables
    reaches only processes forked from now on: the runner's child and the warm ranks are started afresh."""
    before = dict(os.environ)
    chosen = precision.with_kernels(device)
    if dict(os.environ) != before:
        pool.shutdown_pools()
        if runner is not None:
            runner.close()
    return chosen, decisions()[precision.name].note if chosen.kernels else ""


def isolated(plans: Iterable[Plan]) -> IsolatedRunner:
    """One forked child for the in-process runs of ``plans`` (a command's whole matrix): forked once, warm
    across cases, and again only after a run killed it. Close it when done."""
    return IsolatedRunner((p.case, (p.reference, *p.specs)) for p in plans)


def _ahead(plan: Plan, after: int, precision: Precision, measure_memory: bool,
           against: Callable[[Regime], Expected | None]) -> dict[int, Started]:
    """The next distributed run after spec ``after``, started now so its ranks train while this process
    works; none while the reference itself runs on ranks (it would share their pool)."""
    if plan.reference.distributed:
        return {}
    for index in range(after + 1, len(plan.specs)):
        spec = plan.specs[index]
        if spec.distributed and spec != plan.reference:
            return {index: plan.start(spec, precision, measure_memory, against=against(spec))}
    return {}


def _recording_bytes(plan: Plan, precision: Precision) -> int | None:
    """What the reference's recording will hold (every optimizer step's gradients and the final weights), from the
    case's model built on the meta device: no memory, no time, except that its initialisers import torch's compiler
    once (a second, which training imports anyway: where a run goes to ranks, the warm pool's forker starts first, to
    overlap it). None where the model cannot be built there."""
    if any(spec.distributed for spec in plan.specs) and not launcher.active():
        pool.start_forker()
    with seeded(plan.seed), default_dtype(precision.draw_dtype or precision.dtype):
        model = plan.case.skeleton()
    if model is None:  # a factory that reads files or draws data: recorded whole, as a small case is
        return None
    weights = sum(p.numel() for p in model.parameters())
    return weights * (plan.case.steps * plan.case.epochs + 1) * precision.dtype.itemsize


def _outcomes(plan: Plan, precision: Precision, measure_memory: bool, ahead: dict[int, Started],
              streams: bool, anchors: str = "") -> Iterator[Outcome]:
    case, reference, seed = plan.case, plan.reference, plan.seed
    started = time.perf_counter()
    try:
        ref = plan.run(reference, precision, measure_memory, anchor_to=anchors)
        anchored_reference = ref  # anchored runs compare with it where it is (on its GPU, where it held its recording)
        streams = streams or bool(anchors) or ref.recorded_bytes >= COMPARE_AS_IT_TRAINS_FROM
        self_tolerance = tolerance_of(ref, plan.rtol, plan.atol)
        rerun = plan.run(reference, precision, measure_memory, against=Expected(ref, self_tolerance) if streams else None)
    except InvalidArgument:
        raise
    except Exception as error:  # nothing can be compared with a reference that did not run
        crash, details = _crash(error)
        verdict = Verdict.NONDETERMINISTIC if is_nondeterministic_kernel(error) else Verdict.ERROR
        why = f"the reference {reference} failed: {crash}"
        yield from (Outcome(case.name, str(s), verdict, None, why, details=details) for s in plan.specs)
        return
    self_check = compare(ref, rerun, tolerance=self_tolerance)
    ref_seconds = time.perf_counter() - started
    if not self_check.ok:
        kernels = sorted(NONDETERMINISTIC_KERNELS)
        why = f"the reference {reference} disagrees with itself from run to run" + (
            f"; kernels torch has no deterministic form of ran: {', '.join(kernels)}" if kernels else "")
        yield from (Outcome(case.name, str(s), Verdict.NONDETERMINISTIC, self_check, why) for s in plan.specs)
        return

    _warn_lower_precision(case, precision, ref)
    loss_precision = None if plan.rtol is not None else _loss_precision(precision, ref)
    loss_note = "" if loss_precision is None else (
        f"the loss is computed in {loss_precision.dtype if loss_precision.autocast is None else loss_precision.autocast}"
        f" under a {precision.name} case: judged at {loss_precision.name}'s tolerance "
        f"({Tolerance.resolve(loss_precision)})")
    shadow = rounding.shadow_of(precision)
    shadow_reference = functools.cache(lambda: plan.run(reference, shadow, False))
    # a witness recorded whole, or (``tolerance`` given) compared with the reference as it trains, at that tolerance
    witness_run = functools.cache(lambda order, tolerance=None: plan.run(
        reference, precision, False, order, against=None if tolerance is None else Expected(ref, tolerance)))
    witnesses = (lambda orders: [witness_run(order) for order in orders])
    initial = functools.cache(lambda: initial_weights(case, precision, seed, plan.device))
    shadow_initial = functools.cache(lambda: initial_weights(case, PRECISIONS[shadow], seed, plan.device))
    # where the runs' gradients are at rounding level: the reference's own, or in a 16-bit mode (whose 16-bit products
    # make a zero gradient's noise as large as real small ones) the reference's trained in float32 (witness.py)
    levels = None if not precision.low else functools.cache(
        lambda: witness.rounding_levels(plan.run(reference, PRECISIONS["float32"], False)))
    against = (lambda spec: Expected(ref, plan.tolerance(spec, loss_precision))) if streams else (lambda spec: None)
    # (a replay with some modules uncompiled is held to the reference's recording alone: its eager twin stands in)
    traced_reference = functools.cache(lambda steps, modules, eager: plan.run(
        reference, precision, False, trace_steps=steps, trace_modules=modules, trace_eager=eager))
    traced_reference_of = (lambda steps, modules, eager: traced_reference(steps, modules, bool(eager)))
    for index, spec in enumerate(plan.specs):
        if spec == reference:
            yield judge(case, spec, self_check, ref_seconds / 2, rerun, ref, reference)
            continue
        if not ahead and not spec.distributed:  # this run is here: the next distributed one can train meanwhile
            ahead.update(_ahead(plan, index, precision, measure_memory, against))
        started = time.perf_counter()
        tolerance = plan.tolerance(spec, loss_precision)
        try:
            result, comparison = _anchored(plan, spec, precision, measure_memory, anchored_reference, tolerance,
                                           anchors)
            if comparison is None:  # free-running: as it trained, then the reference's rounding and its witnesses
                ref = ref.to(HOST)  # what reads it whole reads it there (an anchored reference kept it on its GPU)
                result = (ahead.pop(index) if index in ahead else
                          plan.start(spec, precision, measure_memory, against=against(spec))).result()
                comparison = witness.by_the_reference(compare(ref, result, tolerance=tolerance), ref, result,
                                                      initial, cause=lambda: rounding.conditioning(case, seed),
                                                      levels=levels)
            if not comparison.ok and result.measured is not None:  # the breakdown reads the run's own tensors
                settled = witness.end_weights_as_it_trained(
                    comparison, ref, result, lambda: witness_run(witness.ORDERS[0], tolerance), initial,
                    cause=lambda: rounding.conditioning(case, seed), levels=levels)
                if settled is None and rounding.applies(precision, comparison):
                    settled = rounding.settled_as_it_trained(
                        case, comparison, ref, result, seed=seed, shadow_reference=shadow_reference,
                        shadow_candidate=lambda against: plan.run(spec, shadow, False, against=against),
                        shadow_initial=shadow_initial)
                if settled is not None:
                    comparison = settled
                else:
                    result, comparison = _recorded(plan, spec, precision, measure_memory, ref, comparison)
        except InvalidArgument:
            raise
        except Unavailable as why:
            yield Outcome(case.name, str(spec), Verdict.SKIPPED, None, str(why))
            continue
        except Exception as error:  # a regime that crashes is a verdict, not the end of the report
            seconds = time.perf_counter() - started
            crash, details = _crash(error)
            declared = expected_mismatch(case, spec)
            if is_nondeterministic_kernel(error):  # torch refused a kernel: no finding about the code either way
                yield Outcome(case.name, str(spec), Verdict.NONDETERMINISTIC, None, crash, seconds, details=details)
            # A rank that died, hung or never started says nothing about the code: never a caught pitfall.
            elif declared is None or (isinstance(error, WorkerError) and not error.raised):
                yield Outcome(case.name, str(spec), Verdict.ERROR, None, crash, seconds, details=details)
            else:  # a declared pitfall that crashes has surfaced as surely as one that mismatches
                yield Outcome(case.name, str(spec), Verdict.EXPECTED_MISMATCH, None,
                              f"{declared}; it crashed: {crash}", seconds, details=details)
            continue
        if rounding.applies(precision, comparison):  # float64 shadows: the maths, or this case's rounding?
            comparison = rounding.judge(
                case, comparison, ref, result, seed=seed,
                shadow_reference=shadow_reference, shadow_initial=shadow_initial,
                shadow_candidate=lambda: plan.run(spec, shadow, False))
        if witness.applies(comparison, ref, result, levels):  # what is left may be noise where a true gradient is zero
            comparison = witness.judge(comparison, ref, result, witnesses, initial,
                                       cause=lambda: rounding.conditioning(case, seed), levels=levels)
        outcome = judge(case, spec, comparison, time.perf_counter() - started, result, ref, reference)
        if plan.locate:
            outcome = _located(outcome, ref, result, lambda steps, modules, eager: (
                traced_reference_of(steps, modules, eager), plan.run(spec, precision, False, trace_steps=steps,
                                                                  trace_modules=modules, trace_eager=eager)),
                               self_check.max_abs)
        yield dataclasses.replace(outcome, reason="; ".join(filter(None, (outcome.reason, loss_note))))


def _anchored(plan: Plan, spec: Regime, precision: Precision, measure_memory: bool, reference: RunResult,
              tolerance: Tolerance, anchors: str) -> tuple[RunResult | None, Comparison | None]:
    """``spec`` trained with each step started from the reference's state in ``anchors`` and judged so, where it can
    be and it matches: (its run, its comparison, saying so). (None, None) where it cannot be anchored, or anchored it
    does not match: a mismatch is then judged free-running, as it trains, with everything that reads such a run
    (the hints, the witnesses, the localizer)."""
    if not anchors or not spec.anchorable or spec.distributed:
        return None, None
    try:
        result = plan.run(spec, precision, measure_memory, against=Expected(reference, tolerance, anchors))
    except (InvalidArgument, Unavailable):
        raise
    except Exception:  # a crash is the free-running run's to report: it trains the regime alone
        return None, None
    comparison = compare(reference, result, tolerance=tolerance)
    if not comparison.ok or result.measured.unanchored:
        return None, None
    return result, dataclasses.replace(comparison, note=ANCHORED)


def _located(outcome: Outcome, reference: RunResult, result: RunResult, replay: localizer.Replay,
             repeat_apart: float) -> Outcome:
    """A failed outcome with where its run first parts from the reference (judge/locate/), its hint kept only where
    it agrees. Nothing is replayed for an outcome as equivalent as its reference: an equivalent check costs what it
    did. A replay that fails leaves the outcome as judged, saying why it cannot say where."""
    comparison = outcome.comparison
    if comparison is None or comparison.ok:
        return outcome
    try:
        location = localizer.locate(comparison, reference, result, replay, repeat_apart)
    except localizer.ReplayDiffers as differs:
        return dataclasses.replace(outcome, reason="; ".join(filter(None, (outcome.reason, f"where it parts is "
                                                                           f"unsaid: {differs}"))))
    except Exception as error:
        why = f"where it parts is unsaid: its replay failed ({type(error).__name__}: {error})"
        return dataclasses.replace(outcome, reason="; ".join(filter(None, (outcome.reason, why))))
    if location is None:
        return outcome
    return dataclasses.replace(outcome, comparison=agreeing(dataclasses.replace(comparison, location=location)))


def _recorded(plan: Plan, spec: Regime, precision: Precision, measure_memory: bool, reference: RunResult,
              measured: Comparison) -> tuple[RunResult, Comparison]:
    """A run compared as it trained that did not match, trained again and recorded whole: the hints, the float64
    shadows and the witness read its tensors. A second run that matches says the regime disagrees with itself."""
    result = plan.run(spec, precision, measure_memory)
    comparison = compare(reference, result, tolerance=measured.tolerance)
    if comparison.ok:
        return result, dataclasses.replace(measured, problems=measured.problems + (Problem(
            ProblemKind.UNSTABLE,
            "the regime disagrees with itself: trained again to record its tensors, it matched the reference"),))
    return result, comparison


# A reference whose recording (every step's gradients, the final weights) would hold at least this many bytes has
# its other runs compared with it as they train, keeping none of their tensors, in this process and on ranks: a check
# then holds one recording, not three or more. Below it, runs are recorded whole, which the breakdown of a mismatch
# reads, and which costs nothing there.
COMPARE_AS_IT_TRAINS_FROM = 64 * 2**20
# A lower-precision check whose reference records at least this many bytes judges its in-process regimes step by step
# from the reference's state (_anchors_each_step): below it, free-running runs and their float64 shadows cost little.
ANCHOR_STEPS_FROM = 64 * 2**20

# The precision mode whose rounding a loss computed in this dtype carries (Tensor.dtype, as RunResult names it).
LOSS_DTYPE_MODES = {"torch.float32": "float32", "torch.bfloat16": "bf16-autocast", "torch.float16": "fp16-autocast"}


def _loss_precision(precision: Precision, reference: RunResult) -> Precision | None:
    """The mode whose tolerance the reference's loss needs, where its dtype rounds coarser than ``precision``
    allows for (a float64 case whose model upcasts logits to float32 for its loss, as Hugging Face causal-LM
    losses do); None where the case's own mode covers it."""
    modes = [PRECISIONS[LOSS_DTYPE_MODES[d]] for d in reference.loss_dtypes if d in LOSS_DTYPE_MODES]
    return max((m for m in modes if m.rtol > precision.rtol), key=lambda m: m.rtol, default=None)


def _warn_lower_precision(case: Case, precision: Precision, reference: RunResult) -> None:
    """A float64 case whose loss comes out in float32 (a model that upcasts logits to float32, as Hugging Face
    causal-LM losses do) runs at float32's rounding, which float64's tolerance does not allow for."""
    lower = [d for d in reference.loss_dtypes if d != str(precision.dtype)]
    if precision.dtype == torch.float64 and lower:
        warn(PrecisionWarning(
            f"case {case.name!r} trains in float64 but its loss is computed in {', '.join(lower)}: the runs carry "
            f"{lower[0]} rounding, so it is judged at that precision's tolerance (each outcome's note says so), not "
            "float64's: keep the loss in float64 for a float64 verdict"))


def _crash(error: Exception) -> tuple[str, str]:
    """The one-line reason and the traceback (a rank's own, where a rank raised) of a run that raised; where torch.func
    refused the activation meter's saved-tensor hook, the way round it."""
    line = f"{type(error).__name__}: {error}"
    if TRANSFORMS_REFUSE_HOOKS in line:
        line += " (equivcheck's activation meter is a saved-tensor hook: measure_memory=False leaves it out)"
    return line, getattr(error, "remote_traceback", "") or traceback.format_exc()


def plan_all(cases: Sequence[Case | str] | None = None, regimes: Iterable[str | Regime] | None = None,
             **options) -> list[Plan]:
    """Plans for several cases (default: every registered one), all validated before any runs. A regime that cannot
    run one of the cases (too many chunks for its batch, no split) is skipped there, saying why (``Plan.misfits``);
    one that fits none of them is a usage error."""
    chosen = [resolve_case(c) for c in cases] if cases is not None else list(all_cases().values())
    if regimes is None:
        return [plan(case, None, **options) for case in chosen]
    specs = [parse_regime(spec) for spec in regimes]
    unfit = misfits(chosen, specs)
    plans = []
    for case in chosen:
        fitting = [spec for spec in specs if (case.name, str(spec)) not in unfit]
        skipped = tuple((str(spec), unfit[(case.name, str(spec))]) for spec in specs if spec not in fitting)
        # A case that fits none of them is still planned (its options validated), against its reference alone.
        planned = plan(case, fitting or [options.get("reference", "full_batch")], **options)
        plans.append(dataclasses.replace(planned, specs=planned.specs if fitting else (), misfits=skipped))
    return plans


def misfits(cases: Sequence[Case], specs: Sequence[Regime]) -> dict[tuple[str, str], str]:
    """Why each (case name, spec) pair that cannot run cannot (``Regime.validate``); a spec that fits none of
    ``cases`` is a usage error, naming the first reason."""
    found: dict[tuple[str, str], str] = {}
    for spec in specs:
        reasons = []
        for case in cases:
            try:
                spec.validate(case)
            except InvalidArgument as error:
                found[(case.name, str(spec))] = str(error)
                reasons.append(str(error))
        if len(reasons) == len(cases):
            raise InvalidArgument(f"regime {str(spec)!r} fits none of the cases asked for: {reasons[0]}")
    return found


def check_all(
    cases: Sequence[Case | str] | None = None, regimes: Iterable[str | Regime] | None = None, *,
    measure_memory: bool = True, **options
) -> Report:
    """Check several cases (default: every registered one) and merge their reports."""
    plans = plan_all(cases, regimes, **options)
    runner = isolated(plans)
    try:
        return Report(tuple(o for p in plans for o in iter_outcomes(p, measure_memory=measure_memory, runner=runner)))
    finally:
        runner.close()


def with_backend(regime: Regime, backend: str | None) -> Regime:
    """``regime`` on ``backend`` where it is distributed and left to choose its backend."""
    if backend is None or not regime.distributed or regime.backend != "auto":
        return regime
    return dataclasses.replace(regime, backend=backend)


def _validate(case: Case, specs: Sequence[Regime]) -> None:
    """Every usage error surfaces before anything runs."""
    for key in case.expect_mismatch:
        if ":" in key:
            parse_regime(key)
        elif key not in REGIMES:
            raise InvalidArgument.unknown("regime", key, REGIMES)
    for spec in specs:
        spec.validate(case)
