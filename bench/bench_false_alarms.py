"""False alarms of the broadened strategies: faithful regimes on drawn cases must all be equivalent,
and pitfalls with a real effect must all be caught.

    python bench/bench_false_alarms.py [--in-process N] [--ddp N] [--attention N] [--attention-ddp N] [--pitfalls N]
                                       [--seed S] [--dtype MODE]

``--compiled N`` draws N in-process configurations, MLPs and attention LMs alike, each regime compiled by
``--compile-backend`` (inductor by default: ``equivcheck.regimes.compiled``), judged against the eager reference.

``--resume N`` draws N resumes: a drawn case (MLP or attention LM, at least two global batches) saved after a drawn
number of them under a drawn regime (one process, DDP or FSDP2 on 1 to 3 ranks) and restored under another drawn one,
each segment on fresh ranks (``equivcheck.regimes.resume``).

``--experts N`` draws N routed-experts cases (2 to 8 experts, top-1 or 2, gates normalised or not, a shared expert
or none, a sequence-wise balance and a router z-loss at drawn weights or left out; float64 or float32) under
accumulation, one sample at a time, DDP (with no_sync), FSDP2, expert parallelism and a dp x ep mesh.

``--anchored`` judges every float32 or autocast in-process check step by step from the reference's state
(``runners/anchors.py``), as a large model's check is, however small the drawn case.

``--tensor N`` draws N MLPs and attention LMs (projections of their own, heads local per rank) made shardable over 2
ranks under ``tp`` and ``fsdp_tp`` (2 and 2 x 2 ranks), and ``--tensor-pitfalls N`` the tensor-parallel pitfalls on
such models.

Draws N in-process configurations (a case from ``equivcheck.strategies.cases()`` and a faithful
in-process regime), N more on attention LMs (``attention_cases()``: causal masks, padding, tied heads, key
biases, Adam without epsilon; RL objectives aggregated as the trainers do, LoRA adapters on a frozen MLP, packed
documents, whose LMs take the ``packed`` regime and its pitfalls besides) in process and on DDP, and N DDP ones (world size 2 or 3, every faithful distributed regime), checks each
and prints every verdict that is not ``equivalent``: a false alarm, since nothing drawn is a pitfall.
Then N pitfall regimes on drawn cases: a pitfall is missed where its float64 shadows differ from the
reference's (it has a real effect) and the verdict in the case's dtype is still ``equivalent``; each miss is tallied
as below or above the mode's own tolerance (the float64 runs judged at it): a difference a mode's tolerance allows is
one a check in that mode does not claim to see.
Draws are derandomized by ``--seed``, so a run is repeatable. ``--dtype`` runs every check in one
precision mode (e.g. ``fp16-autocast`` on a CUDA machine) instead of each drawn case's own dtype. DDP ranks rebuild each drawn case from
its plain values (``CaseSpec``), which this file registers at import from the file named in
``EQUIVCHECK_DRAWN_CASES``: the ranks import this file and register the same cases.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile
import time

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.strategies import CaseSpec, attention_specs, case_specs, regime_specs
from equivcheck.precision import PRECISIONS, SHADOW
from equivcheck.regimes import REGIMES

DRAWN_CASES = "EQUIVCHECK_DRAWN_CASES"
def _drawable(cls) -> bool:
    """Whether regime_specs can draw every required field (a team's fn=, a pipeline's stages= it cannot)."""
    return all(f.name in ("world_size", "chunks") or f.default is not dataclasses.MISSING
               or f.default_factory is not dataclasses.MISSING for f in dataclasses.fields(cls))


IN_PROCESS = ["sample_by_sample", "accumulate", "retained_graph", "detached_partial"]
PITFALLS = ["naive_accumulate", "zero_grad_inside", "step_per_micro_batch", "sampler_pad", "sampler_drop",
            "scaler_unscale_per_micro_batch", "scaler_step_per_micro_batch"]
# What a drawn attention LM on packed documents takes besides: the packed regimes, and the packing pitfalls.
PACKED, PACKED_PITFALLS = ["packed"], ["packed_row_mean", "packed_label_across", "packed_positions_run_on"]
DISTRIBUTED = sorted(n for n, cls in REGIMES.items() if cls.distributed and not cls.pitfall and not cls.trap
                     and not cls.fits_some_cases and n != "data_parallel" and _drawable(cls))


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """A drawn routed-experts case (the built-in family's model and terms, ``equivcheck_cases.experts``), in plain
    values: ``build()`` makes the same case on every rank."""

    experts: int
    k: int
    normalise: bool
    shared: bool
    balance: float
    z: float
    batch_size: int
    dtype: str

    @property
    def name(self) -> str:
        return (f"drawn_experts_e{self.experts}_k{self.k}{'_norm' if self.normalise else ''}"
                f"{'_shared' if self.shared else ''}_b{self.balance:g}_z{self.z:g}_bs{self.batch_size}_{self.dtype}")

    def build(self) -> ec.Case:
        from equivcheck_cases.experts import routed_case

        return routed_case(self.name, experts=self.experts, k=self.k, normalise=self.normalise, shared=self.shared,
                           balance=self.balance, z=self.z, batch_size=self.batch_size,
                           dtype=PRECISIONS[self.dtype].dtype, description=f"drawn: {self}")


SPECS = {"CaseSpec": CaseSpec, "ExpertsSpec": ExpertsSpec}  # what a listing's entries are, by their "kind"


def register_drawn(path: str) -> list[ec.Case]:
    """Register every case spec listed in the JSON file ``path`` (at the top level: ranks import this file)."""
    with open(path) as listing:
        specs = [SPECS[spec.pop("kind", "CaseSpec")](**{k: tuple(v) if isinstance(v, list) else v
                                                       for k, v in spec.items()})
                 for spec in json.load(listing)]
    return [ec.register_case(spec.build()) for spec in specs]


if os.environ.get(DRAWN_CASES):
    DRAWN = register_drawn(os.environ[DRAWN_CASES])


def draws(strategy: st.SearchStrategy, count: int, draw_seed: int) -> list:
    """``count`` draws of ``strategy``, the same for the same ``draw_seed`` (generation only, no shrinking)."""
    drawn = []

    @seed(draw_seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value):
        drawn.append(value)

    collect()
    return drawn[:count]


@st.composite
def configurations(draw, names: list[str], min_world_size: int = 1, max_world_size: int = 4, attention: bool = False,
                   packed_names: tuple[str, ...] = ()):
    """A drawn case (an MLP, or with ``attention`` a causal attention LM) and a regime of ``names`` it can take, or of
    ``packed_names`` where the LM's documents are packed (half the packed LMs draw one of those alone: among every
    regime they would be one draw in a dozen)."""
    spec = draw(attention_specs() if attention else case_specs())
    packed_only = spec.packed and packed_names and draw(st.booleans())
    names = [n for n in (packed_names if packed_only else [*names, *(packed_names if spec.packed else ())])
             if not (spec.tied and REGIMES[n].needs_split)]  # a tied head has no trunk of its own
    regime = draw(regime_specs(spec.batch_size, names=names, min_world_size=min(min_world_size, spec.batch_size),
                               max_world_size=max_world_size))
    return spec, regime


def compiled(regime: str, backend: str) -> str:
    """``regime``'s spec with its module compiled by ``backend``."""
    return f"{regime}{',' if ':' in regime else ':'}compile={backend}"


RESUMED = ["full_batch", "accumulate", "ddp", "ddp_no_sync", "fsdp"]  # what a resume joins in the drawn sweep


@st.composite
def resume_configurations(draw):
    """A drawn case of two global batches or more, saved after ``at`` of them under one regime of RESUMED and
    restored under another (the world sizes drawn apart: a resharding)."""
    spec = draw(st.one_of(case_specs(), attention_specs()))
    spec = dataclasses.replace(spec, steps=max(spec.steps, 2), batch_size=max(spec.batch_size, 3))
    names = [n for n in RESUMED if not (spec.tied and REGIMES[n].needs_split)]
    regimes = regime_specs(spec.batch_size, names=names, min_world_size=1, max_world_size=min(3, spec.batch_size))
    before, after = draw(regimes), draw(regimes)
    at = draw(st.integers(1, spec.steps - 1))
    return spec, f"{before}>resume:at={at}>{after}"


EXPERTS = ["accumulate", "sample_by_sample", "ddp", "ddp_no_sync", "fsdp", "ep", "fsdp_ep"]


@st.composite
def experts_configurations(draw):
    """A drawn routed-experts case (E experts, top-k, gates normalised or not, a shared expert or none, the balance
    and z terms at drawn weights or left out, float64 or float32) and a faithful regime of EXPERTS: accumulation,
    one sample at a time, DDP (with no_sync), FSDP2, expert parallelism over a W dividing E, or a dp x ep mesh."""
    experts = draw(st.sampled_from([2, 4, 6, 8]))
    spec = ExpertsSpec(experts=experts, k=draw(st.integers(1, min(2, experts))), normalise=draw(st.booleans()),
                       shared=draw(st.booleans()), balance=draw(st.sampled_from([0.0, 0.01, 0.1, 1.0])),
                       z=draw(st.sampled_from([0.0, 0.001, 0.01])), batch_size=draw(st.sampled_from([8, 12, 24])),
                       dtype=draw(st.sampled_from(["float64", "float32"])))
    name = draw(st.sampled_from(EXPERTS))
    if name in ("accumulate", "ddp_no_sync"):
        chunks = draw(st.integers(2, 6))
    if name == "accumulate":
        return spec, f"accumulate:chunks={chunks}"
    if name == "sample_by_sample":
        return spec, name
    ep = draw(st.sampled_from([w for w in (2, 4) if experts % w == 0] or [1]))
    if name == "ep":
        return spec, f"ep:world_size={ep}"
    if name == "fsdp_ep":
        return spec, f"fsdp_ep:dp={draw(st.integers(1, 4 // ep))},ep={ep}"
    world = draw(st.integers(2, 3))
    if name == "ddp_no_sync":  # every rank's shard cut into micro-batches of a sample at least
        return spec, f"ddp_no_sync:world_size={world},chunks={min(chunks, spec.batch_size // world)}"
    return spec, f"{name}:world_size={world}"


TENSOR = ["tp:world_size=2", "fsdp_tp:dp=2,tp=2"]
TENSOR_PITFALLS = ["tp_different_batches:world_size=2", "tp_loss_scaled:world_size=2", "fsdp_tp_world_scaled:dp=2,tp=2"]


@st.composite
def tensor_configurations(draw, regimes: list[str]):
    """A drawn model made shardable over 2 tensor-parallel ranks, and a regime of ``regimes``: TP on 2 ranks, or
    FSDP2 x TP on a 2 x 2 mesh. Half are MLPs (a hidden layer at least, hidden widths doubled: even; no norm between
    their Linears, so the derived plan is colwise, rowwise per pair), half causal attention LMs whose attention has
    projections of its own (an even number of heads: the plan keeps half on each rank) beside its MLP."""
    if draw(st.booleans()):
        spec = draw(attention_specs(heads=st.sampled_from([2, 4]), split_attention=st.just(True),
                                    aggregations=st.just(""), adapters=st.just(False), packed=st.just(False)))
    else:
        spec = draw(case_specs())
        hidden = spec.widths[1:-1] or (2,)  # at least one hidden layer: a Linear pair to shard
        widths = (spec.widths[0], *(2 * width for width in hidden), spec.widths[-1])
        spec = dataclasses.replace(spec, widths=widths, norm="none", groups=(), batchnorm=False)
    spec = dataclasses.replace(spec, batch_size=max(spec.batch_size, 2))  # two data-parallel groups: a sample each
    return spec, draw(st.sampled_from(regimes))


def run(configs: list[tuple[CaseSpec, str]], label: str, dtype: str | None = None) -> dict:
    """Check every configuration; tally the verdicts and print each false alarm."""
    tally, notes, chunks_one, alarms = collections.Counter(), 0, 0, []
    started = time.perf_counter()
    for spec, regime in configs:
        case = ec.get_case(spec.name) if spec.name in ec.all_cases() else spec.build()
        (outcome,) = ec.check(case, [regime], measure_memory=False, dtype=dtype).outcomes
        tally[outcome.verdict.value] += 1
        notes += outcome.verdict is Verdict.EQUIVALENT and outcome.reason.startswith(("ill-conditioned", "chaotic"))
        chunks_one += getattr(ec.parse_regime(regime), "chunks", None) == 1
        # SKIPPED: this machine cannot run the regime (SyncBatchNorm without GPUs): no verdict, so no alarm;
        # the tally shows how many
        if outcome.verdict not in (Verdict.EQUIVALENT, Verdict.SKIPPED):
            alarms.append(outcome)
            print(f"FALSE ALARM {label}: {outcome.describe()[:600]}\n  case: {spec}", flush=True)
    seconds = time.perf_counter() - started
    print(f"{label}: {len(configs)} configurations in {seconds:.0f} s: {dict(tally)}; "
          f"{notes} equivalent as ill-conditioned (float32 rounding, float64 maths equal); "
          f"{chunks_one} with chunks=1 ({chunks_one / max(len(configs), 1):.1%}); {len(alarms)} false alarms",
          flush=True)
    return {"configurations": len(configs), "verdicts": dict(tally), "ill_conditioned": notes,
            "false_alarms": len(alarms), "seconds": round(seconds, 1)}


def missed_pitfalls(configs: list[tuple[CaseSpec, str]], label: str = "MLPs", dtype: str | None = None) -> dict:
    """Each pitfall regime on a drawn case, in the case's dtype: missed where it has a real effect (in
    float64 from the same draws it differs from the reference) and the verdict is still equivalent."""
    tally, missed = collections.Counter(), []
    started = time.perf_counter()
    for spec, regime in configs:
        case = ec.get_case(spec.name) if spec.name in ec.all_cases() else spec.build()
        try:
            (outcome,) = ec.check(case, [regime], measure_memory=False, dtype=dtype).outcomes
            # The exact maths from the same draws: the run itself in float64, the shadow of a float32 one.
            exact = "float64" if (dtype or spec.dtype) == "float64" else SHADOW
            (maths,) = ec.check(case, [regime], measure_memory=False, dtype=exact).outcomes
        except ec.InvalidArgument:  # a pitfall that cannot apply to this case (a sampler with nothing to pad)
            tally["not applicable"] += 1
            continue
        effect = maths.verdict is not Verdict.EQUIVALENT
        caught = outcome.verdict is not Verdict.EQUIVALENT
        if effect and not caught:  # is the exact maths' difference one the mode's own tolerance can see?
            mode = PRECISIONS[dtype or spec.dtype]
            (seen,) = ec.check(case, [regime], measure_memory=False, dtype=exact, rtol=mode.rtol,
                               atol=mode.atol).outcomes
            tally["missed below the mode's tolerance" if seen.verdict is Verdict.EQUIVALENT else
                  "missed above the mode's tolerance"] += 1
        # A pitfall that crashes its ranks (TP ranks fed shards of different sizes: a collective of mismatched
        # sizes) is no silent pass, but no verdict on the numbers either: counted apart.
        shown = ", crashed" if outcome.verdict is Verdict.ERROR else ", caught" if caught else ", passed"
        tally[("effect" if effect else "no effect") + shown] += 1
        if effect and not caught:
            missed.append(outcome)
            print(f"MISSED PITFALL: {outcome.describe()[:400]}\n  float64: {maths.describe()[:300]}\n  case: {spec}",
                  flush=True)
    seconds = time.perf_counter() - started
    below = tally["missed below the mode's tolerance"]
    print(f"pitfalls ({label}): {len(configs)} configurations in {seconds:.0f} s: {dict(tally)}; {len(missed)} missed "
          f"with a real effect, {below} of them below the mode's tolerance (its float64 runs judged at it match)",
          flush=True)
    return {"configurations": len(configs), "outcomes": dict(tally), "missed": len(missed),
            "missed_above_tolerance": len(missed) - below, "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-process", type=int, default=10_000)
    parser.add_argument("--ddp", type=int, default=300)
    parser.add_argument("--pitfalls", type=int, default=1000)
    parser.add_argument("--attention", type=int, default=2000, help="in-process configurations of attention LMs")
    parser.add_argument("--attention-ddp", type=int, default=200, help="DDP configurations of attention LMs")
    parser.add_argument("--attention-pitfalls", type=int, default=300, help="pitfall regimes on attention LMs")
    parser.add_argument("--tensor", type=int, default=300,
                        help="drawn MLPs and attention LMs under tp and fsdp_tp (2 and 2 x 2 ranks)")
    parser.add_argument("--tensor-pitfalls", type=int, default=100, help="TP pitfalls on drawn MLPs and attention LMs")
    parser.add_argument("--compiled", type=int, default=300,
                        help="in-process configurations (MLPs and attention LMs) with the regime compiled")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--resume", type=int, default=100, help="drawn resumes, resharded between drawn regimes")
    parser.add_argument("--experts", type=int, default=200,
                        help="drawn routed-experts cases under accumulation, DDP, FSDP2, ep and dp x ep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(PRECISIONS), help="one precision mode for every check "
                        "(default: each drawn case's dtype)")
    parser.add_argument("--anchored", action="store_true", help="every lower-precision in-process check judged step "
                        "by step from the reference's state, however small its case (check.ANCHOR_STEPS_FROM = 0)")
    args = parser.parse_args(argv)
    if args.anchored:
        sys.modules["equivcheck.check"].ANCHOR_STEPS_FROM = 0
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the ranks' DDP warnings (find_unused_parameters)
    print(f"torch {__import__('torch').__version__}; seed {args.seed}; in-process regimes {IN_PROCESS}; "
          f"DDP regimes {DISTRIBUTED}; dtype {args.dtype or 'per drawn case'}", flush=True)
    results = {}
    distributed = {label: draws(configurations(DISTRIBUTED, min_world_size=2, max_world_size=3,
                                               attention=label == "attention DDP"), count, args.seed)
                   for label, count in (("DDP", args.ddp), ("attention DDP", args.attention_ddp)) if count}
    if args.resume:
        distributed["resume"] = draws(resume_configurations(), args.resume, args.seed)
    if args.experts:
        distributed["experts"] = draws(experts_configurations(), args.experts, args.seed)
    distributed |= {label: draws(tensor_configurations(regimes), count, args.seed)
                    for label, regimes, count in (("tensor", TENSOR, args.tensor),
                                                  ("tensor pitfalls", TENSOR_PITFALLS, args.tensor_pitfalls)) if count}
    if distributed:
        listing = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="equivcheck-drawn-", delete=False)
        with listing:
            specs = dict.fromkeys(spec for configs in distributed.values() for spec, _ in configs)
            json.dump([{"kind": type(spec).__name__, **dataclasses.asdict(spec)} for spec in specs], listing)
        os.environ[DRAWN_CASES] = listing.name  # before the pool starts: its ranks inherit it
        try:
            register_drawn(listing.name)
            for label, configs in distributed.items():
                judge = missed_pitfalls if label == "tensor pitfalls" else run
                results[label.replace(" ", "_").lower()] = judge(configs, label, args.dtype)
        finally:
            os.unlink(listing.name)
    if args.in_process:
        results["in_process"] = run(draws(configurations(IN_PROCESS), args.in_process, args.seed), "in-process",
                                    args.dtype)
    if args.attention:
        results["attention"] = run(draws(configurations(IN_PROCESS, attention=True, packed_names=PACKED),
                                         args.attention, args.seed), "attention in-process", args.dtype)
    if args.compiled:
        whole = [n for n in IN_PROCESS if not REGIMES[n].needs_split]  # one that trains the parts compiles nothing
        drawn = draws(st.one_of(configurations(whole), configurations(whole, attention=True)), args.compiled,
                      args.seed)
        results["compiled"] = run([(spec, compiled(regime, args.compile_backend)) for spec, regime in drawn],
                                  f"compiled ({args.compile_backend})", args.dtype)
    if args.pitfalls:
        results["pitfalls"] = missed_pitfalls(draws(configurations(PITFALLS), args.pitfalls, args.seed), "MLPs",
                                              args.dtype)
    if args.attention_pitfalls:
        results["attention_pitfalls"] = missed_pitfalls(
            draws(configurations(PITFALLS, attention=True, packed_names=PACKED_PITFALLS), args.attention_pitfalls,
                  args.seed), "attention LMs",
            args.dtype)
    print(json.dumps(results))
    return 1 if any(r.get("false_alarms") or r.get("missed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
