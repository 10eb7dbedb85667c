"""The CI gate on a team's own training code: ``check_step`` and ``check_loop``.

``check_step(case, step)`` runs ``step(model, optimizer, (inputs, targets))`` once per global batch
of the case, from the same seeded start as the reference, and compares every gradient (taken when
the step calls ``optimizer.step()``), the final weights and the losses. ``check_loop`` does the
same for a function that runs a whole loop over the batches (schedulers and other state that lives
across steps belong there). The step returns the global batch's mean loss, or None to leave losses
out of the comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor, nn
from torch.optim import Optimizer

from .suites.audit import warn_blind_spots
from .case import Case
from .judge.verdict import Report
from .check import check
from .errors import InvalidArgument, expect_callable
from .regimes import Regime
from .regimes.base import COLLECTIVE_KIND, collectives_spec
from .process.seeding import DEFAULT_SEED
from .regimes.ddp import DDP_OPTIONS
from .regimes.resume import Resume
from .process.import_paths import import_path
from .registry import resolve_case
from .regimes.user_code import (MESH_DIMENSIONS, DdpLoop, DdpStep, LoopFn, MeshLoop, MeshStep, PipelineLoop,
                                PipelineStep, StepFn, UserLoop, UserStep)


def check_step(
    case: Case | str,
    step: StepFn,
    reference: str | Regime | StepFn | None = None,
    *,
    world_size: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    per_run: bool = False,
    ddp_options: dict | None = None,
    optimizer_wrap: Callable[[Optimizer], Optimizer] | None = None,
    pipeline: bool = False,
    syncs_per_step: int | None = None,
    mesh: dict[str, int] | None = None,
    parallelize: Callable | None = None,
    collectives: dict[str, int] | None = None,
    gather: Callable[[str, Tensor], Tensor] | None = None,
    resume: Checkpoint | None = None,
    **options,
) -> Report:
    """Check a team's ``step(model, optimizer, batch)`` against ``reference``: a regime spec, or another
    step function (the code before a refactor, or full batch with the same clipping); by default full batch, clipped
    at the case's ``max_norm`` where it declares the threshold the team's code clips at. With ``per_run``,
    ``step`` is a factory called at the start of every run to make the step: a step that keeps state
    across calls (a GradScaler, a schedule) keeps it there, fresh for each run. ``step`` returns the mean loss of
    the batch it was handed, or None. On ranks (``world_size``, ``mesh``) the losses the ranks return are averaged
    over all of them (every rank of a mesh, its TP ranks too): the global batch's mean where each rank returns its
    shard's mean and the shards hold as many items each, and the loss compared with the reference's (a step that
    already averages its loss over the data-parallel ranks returns the global batch's mean on every rank, which the
    average leaves as it is).

    With ``world_size`` the step runs on that many DDP ranks of the warm pool (see ``regimes.user_code``),
    given the model in DistributedDataParallel, or what the team's ``wrap(model)`` makes of it (the
    trunk and the head each in DDP, say), made with ``ddp_options`` (``{"find_unused_parameters": True}``;
    any of ``DistributedDataParallel``'s options that equivcheck's ddp regimes take), and handed the
    optimizer that the team's ``optimizer_wrap(optimizer)`` makes of the case's own (``ZeroRedundancyOptimizer``
    around it, as :func:`equivcheck.regimes.zero.sharded_like` builds it: its state sharded over the ranks,
    its broadcasts counted). ``wrap`` and ``optimizer_wrap`` must be module-level functions: the ranks import
    them by name. A faithful step syncs the gradients once per optimizer step (per wrapped module); any other count
    is a ``communication`` verdict. ``syncs_per_step=K`` declares the K a step makes on purpose (ZeRO-2, which
    reduces every one of K micro-batches), and any other count is then the problem.

    With ``pipeline=True`` the step runs its own pipeline schedule (``torch.distributed.pipelining``) on
    ``world_size`` ranks instead of DDP: each rank is handed the whole model, unwrapped, the case's optimizer
    over all of it and the whole global batch, and builds its own stage from its rank (``PipelineStage``, a
    schedule, ``schedule.step``); it returns its loss on the last stage and 0 or None on the others (they are
    added). When it calls ``optimizer.step()``, every parameter's gradient is first broadcast from the rank whose
    stage holds it, so every rank steps and reports the whole model (that broadcast is not counted; the
    schedule's sends and receives are). A flag, not a wrapping function like ``wrap``: the harness wraps nothing
    (the team's step cuts the stages and makes the schedule); it only changes what every rank is handed and
    gathers the stages' gradients back. It takes no ``wrap``, ``ddp_options`` or ``optimizer_wrap`` (a
    pipeline takes no DDP).

    With ``mesh={"dp": D, "tp": T}`` (either left out: 1; ``"cp": C`` adds a context-parallel dimension between
    them, ``"ep": E`` an expert-parallel one after ``dp``, whose ranks hold shards of their own) the step runs on
    ``D * T`` (``D * E * C * T``) ranks laid out as a ``D x T`` (``D x E x C x T``) mesh
    (``init_device_mesh`` with those names), after the team's ``parallelize(model, mesh)`` has applied its own plan
    and returned the model: ``parallelize_module`` with its styles, ``fully_shard`` over ``mesh["dp"]``, its own
    layers built on raw collectives, its own context-parallel split. The case's optimizer is made over what it
    returns. The ranks of one data-parallel group (its C x T ranks) are handed its shard of every global batch, the
    same on each; weights and
    gradients are read back whole through DTensor's ``full_tensor()``, and a plain-tensor parameter is taken as
    replicated: it must end the same on every rank (else ``ranks disagree``). ``parallelize`` is found by name as
    ``wrap`` is. Every collective of a step is counted by kind and mesh dimension (``"all_reduce[tp]"``,
    ``"all_gather[dp]"``); ``collectives={"all_reduce[tp]": 2}`` declares what a faithful step makes, and a step that
    makes another count of any kind is a ``communication`` verdict. A team whose own layers keep plain local shards
    hands over ``gather(name, local)``: the whole tensor of parameter ``name`` (its weight, or its gradient) from this
    rank's shard, by its own collectives (uncounted: the harness's read-back), found by name as ``parallelize`` is.
    ``gather`` runs on every rank in lockstep, for every parameter name of the case's model in one order, so a gather
    made of collectives (an ``all_gather`` over the TP group) meets its peers; it must make the same collectives on
    every rank. ``local`` is None on a rank that holds no part of ``name`` (an expert that lives on another rank).
    Experts numbered locally on each rank (Megatron's) need no gather: ``parallelize`` returns ``(model, names)``,
    ``names`` this rank's parameter names to the case's model's, and what only some ranks hold is broadcast from one.
    With ``resume=Checkpoint(at=K, save=..., load=...)`` the run is resumed from the team's own checkpoint: after K
    global batches its ranks call ``save`` and end, ranks started afresh build the model anew, call ``load`` and the
    step trains on (see :class:`Checkpoint`); every gradient, the losses and the final weights are held to the
    uninterrupted reference.

    ``options`` go to :func:`equivcheck.check` (rtol, atol, seed, backend, timeout).
    """
    reference = _reference(case, reference, UserStep)
    if not isinstance(per_run, bool):
        raise InvalidArgument.type("per_run", per_run, "bool")
    candidate = _candidate("step", step, world_size, mesh, parallelize, collectives, gather,
                           {"wrap": wrap, "ddp_options": ddp_options, "optimizer_wrap": optimizer_wrap,
                            "pipeline": pipeline, "syncs_per_step": syncs_per_step}, per_run=per_run)
    if resume is not None:
        candidate = _resumed(candidate, resume)
    warn_blind_spots(case, seed=options.get("seed", DEFAULT_SEED), isolate=options.get("isolate", False))
    return check(case, [candidate], reference=reference, **options)


def check_loop(
    case: Case | str,
    loop: LoopFn,
    reference: str | Regime | LoopFn | None = None,
    *,
    world_size: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    ddp_options: dict | None = None,
    optimizer_wrap: Callable[[Optimizer], Optimizer] | None = None,
    pipeline: bool = False,
    syncs_per_step: int | None = None,
    mesh: dict[str, int] | None = None,
    parallelize: Callable | None = None,
    collectives: dict[str, int] | None = None,
    gather: Callable[[str, Tensor], Tensor] | None = None,
    resume: Checkpoint | None = None,
    **options,
) -> Report:
    """Check a team's ``loop(model, optimizer, batches)`` against ``reference`` (a spec or another loop);
    with ``world_size``, the loop on that many DDP ranks, each given its shard of every global batch, the
    model in DDP made with ``ddp_options`` and the optimizer made by ``optimizer_wrap``, or with ``pipeline=True``
    the loop running its own pipeline schedule on every rank, given every whole global batch; with ``mesh`` and
    ``parallelize``, on a mesh, each TP group given its data-parallel shard of every global batch (as
    :func:`check_step`). With ``resume=Checkpoint(at=K, save=..., load=...)`` the loop is resumed: its ranks are
    handed the first K global batches, then ``save`` is called; ranks started afresh build the model anew, call
    ``load``, and the loop is handed every global batch again, as the uninterrupted run's loop was, so skipping the K
    it trained before is the loop's own restored position's work (a sampler's epoch and offset)."""
    reference = _reference(case, reference, UserLoop)
    candidate = _candidate("loop", loop, world_size, mesh, parallelize, collectives, gather,
                           {"wrap": wrap, "ddp_options": ddp_options, "optimizer_wrap": optimizer_wrap,
                            "pipeline": pipeline, "syncs_per_step": syncs_per_step})
    if resume is not None:
        candidate = _resumed(candidate, resume)
    warn_blind_spots(case, seed=options.get("seed", DEFAULT_SEED), isolate=options.get("isolate", False))
    return check(case, [candidate], reference=reference, **options)


def _reference(case: Case | str, given: object, own: type) -> str | Regime:
    """The reference a team's code is held to: ``given`` (a spec, or the team's own code in ``own``), else full batch
    clipped as the case says the team's code clips (``Case(max_norm=M)``)."""
    if given is None:
        max_norm = resolve_case(case).max_norm
        return "full_batch" if max_norm is None else f"full_batch:max_norm={max_norm!r}"
    return given if isinstance(given, (str, Regime)) else own(given)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A resume of a team's step or loop (``check_step(..., resume=...)``, ``check_loop``): after ``at`` global batches every rank calls
    ``save(model, optimizer, folder)`` (handed what its step is handed) and the ranks end; ranks started afresh build
    the model anew, call ``load(model, optimizer, folder)``, and the step trains on from global batch ``at``, on
    ``world_size`` ranks where given (a DDP step resharded), else as many as before; ``at=(K1, K2)`` restarts the run
    once after each, every restored segment loading what the one before it saved. ``save`` and ``load`` are
    module-level functions (the ranks import them by name); both left out, the checkpoint is equivcheck's own
    (``torch.distributed.checkpoint``, each rank's random state), the baseline a team's is held beside."""

    at: int | tuple[int, ...]
    save: Callable | None = None
    load: Callable | None = None
    world_size: int | None = None


def _resumed(candidate: Regime, resume: Checkpoint) -> Regime:
    if not isinstance(resume, Checkpoint):
        raise InvalidArgument.type("resume", resume, "an equivcheck.Checkpoint(at=K, save=..., load=...)")
    after = None
    if resume.world_size is not None:
        if "world_size" not in {f.name for f in dataclasses.fields(candidate)}:
            raise InvalidArgument.value("world_size", resume.world_size, "left out for a step on a mesh (the "
                                        "restored step runs on the mesh it was saved on)")
        after = dataclasses.replace(candidate, world_size=resume.world_size)
    paths = {name: "" if fn is None else import_path(fn, name) for name, fn in (("save", resume.save),
                                                                               ("load", resume.load))}
    ats = (resume.at,) if isinstance(resume.at, int) else tuple(resume.at)
    if not ats:
        raise InvalidArgument.value("at", resume.at, "a global batch, or several in increasing order")
    made = candidate
    for index, at in enumerate(ats):  # each later save restores on the regime the first restore chose
        made = Resume(at=at, before=made, after=after if index == 0 else None, **paths)
    return made


# The regimes a team's step or loop runs under: in this process, on DDP ranks, running its own pipeline, on a mesh.
_TEAM_REGIMES = {"step": (UserStep, DdpStep, PipelineStep, MeshStep),
                 "loop": (UserLoop, DdpLoop, PipelineLoop, MeshLoop)}


def _candidate(argument: str, fn: Callable, world_size: int | None, mesh: dict[str, int] | None,
               parallelize: Callable | None, collectives: dict[str, int] | None, gather: Callable | None,
               ranks_only: dict, **fields) -> Regime:
    """The regime the team's ``fn`` (its ``argument``: a step or a loop) runs under, from the call's arguments."""
    in_process, on_ddp, own_pipeline, on_mesh = _TEAM_REGIMES[argument]
    _expect_mesh_for(mesh, parallelize, collectives=collectives, gather=gather)
    if mesh is not None or parallelize is not None:
        return _on_mesh(on_mesh, argument, fn, mesh, parallelize, world_size, ranks_only,
                        collectives=_declared(collectives), gatherer=_gatherer(gather), **fields)
    if _in_process(world_size, **ranks_only):
        return in_process(fn, **fields)
    return _on_ranks((on_ddp, own_pipeline), argument, fn, world_size, **ranks_only, **fields)


# Why each argument that only ranks take is refused without world_size.
_RANKS_ONLY = {"wrap": "the model is wrapped for DDP ranks only",
               "ddp_options": "the options are DistributedDataParallel's",
               "optimizer_wrap": "the optimizer is sharded over DDP ranks only",
               "pipeline": "a pipeline's stages are spread over ranks, one each",
               "syncs_per_step": "only DDP ranks sync gradients"}


def _in_process(world_size: int | None, **ranks_only) -> bool:
    if not isinstance(ranks_only["pipeline"], bool):
        raise InvalidArgument.type("pipeline", ranks_only["pipeline"], "bool")
    if world_size is None:
        for argument, value in ranks_only.items():
            if _given(value):
                raise InvalidArgument(f"{argument}={value!r} is not allowed without world_size: expected world_size= "
                                      f"with it ({_RANKS_ONLY[argument]})")
    return world_size is None


def _on_mesh(regime: type[MeshStep], argument: str, fn: Callable, mesh: dict[str, int] | None,
             parallelize: Callable | None, world_size: int | None, ranks_only: dict, **fields) -> MeshStep:
    """The team's code on a mesh: it and its parallelize travel by import path, which the ranks resolve."""
    if mesh is None or parallelize is None:
        missing = "mesh" if mesh is None else "parallelize"
        raise InvalidArgument(f"{missing}=None is not allowed with {'parallelize' if mesh is None else 'mesh'}=: "
                              "expected both (the mesh's sizes by name, and the team's parallelize(model, mesh))")
    if not isinstance(mesh, dict) or not mesh or not set(mesh) <= set(MESH_DIMENSIONS):
        raise InvalidArgument.value("mesh", mesh, "a dict of dimension sizes by name, among "
                                    + ", ".join(map(repr, MESH_DIMENSIONS)) + ' ({"dp": 2, "tp": 2})')
    for name, value in ranks_only.items():
        if _given(value):
            raise InvalidArgument(f"{name}={value!r} is not allowed with mesh=: expected {name} left out (the "
                                  "team's parallelize applies its whole plan, data parallelism included)")
    expect_callable(argument, fn)
    expect_callable("parallelize", parallelize)
    made = regime(fn=import_path(fn, argument), parallelizer=import_path(parallelize, "parallelize"), **mesh,
                  **fields)
    if world_size is not None and world_size != made.world_size:
        raise InvalidArgument.value("world_size", world_size, f"{made.world_size} (the mesh's ranks), or left out")
    return made


# Why each argument that only a mesh takes is refused without one.
_MESH_ONLY = {"collectives": "a step's collectives are declared by mesh dimension; on DDP ranks, syncs_per_step= "
                             "declares its gradient syncs",
              "gather": "a team's local shards are gathered over its mesh; on DDP ranks every rank holds the model"}


def _expect_mesh_for(mesh: object, parallelize: object, **mesh_only: object) -> None:
    for name, value in mesh_only.items():
        if value is not None and mesh is None and parallelize is None:
            raise InvalidArgument(f"{name}={value!r} is not allowed without mesh=: expected mesh= and parallelize= "
                                  f"({_MESH_ONLY[name]})")


def _gatherer(gather: Callable | None) -> str:
    """The team's gather as the mesh regime's spec field (its import path); '' where none is handed over."""
    if gather is None:
        return ""
    expect_callable("gather", gather)
    return import_path(gather, "gather")


def _declared(collectives: dict[str, int] | None) -> str:
    """A team's declared collectives as the mesh regime's spec field; '' where none are declared."""
    if collectives is None:
        return ""
    if not isinstance(collectives, dict) or not all(
            isinstance(kind, str) and COLLECTIVE_KIND.fullmatch(kind) and isinstance(calls, int)
            and not isinstance(calls, bool) and calls >= 0 for kind, calls in collectives.items()):
        raise InvalidArgument.value("collectives", collectives, 'a dict of collective kinds to calls per step '
                                    '({"all_reduce[tp]": 2, "all_gather[dp]": 4}; kinds as a check counts them)')
    return collectives_spec(collectives)


def _given(value: object) -> bool:
    """Whether a ranks-only argument was given: anything but its defaults (None, False) and an empty dict."""
    return value is not None and value is not False and value != {}


def _on_ranks(regimes: tuple[type[DdpStep], type[PipelineStep]], argument: str, fn: Callable, world_size: int,
              wrap: Callable | None, ddp_options: dict | None, optimizer_wrap: Callable | None, pipeline: bool,
              syncs_per_step: int | None, **fields) -> DdpStep | PipelineStep:
    """The team's code on DDP ranks, or running its own pipeline on ranks: it and its wraps travel by import
    path, which the ranks resolve."""
    expect_callable(argument, fn)
    path = import_path(fn, argument)
    ddp_step, pipeline_step = regimes
    if pipeline:
        for name, given in (("wrap", wrap), ("ddp_options", ddp_options), ("optimizer_wrap", optimizer_wrap),
                            ("syncs_per_step", syncs_per_step)):
            if _given(given):
                raise InvalidArgument(f"{name}={given!r} is not allowed with pipeline=True: expected {name}=None (a "
                                      "pipeline takes no DDP: every rank is handed the whole model, unwrapped, and "
                                      "the case's own optimizer)")
        return pipeline_step(world_size=world_size, fn=path, **fields)
    wrappers = {}
    for name, field, given in (("wrap", "wrapper", wrap), ("optimizer_wrap", "optimizer_wrapper", optimizer_wrap)):
        if given is not None:
            expect_callable(name, given)
        wrappers[field] = "" if given is None else import_path(given, name)
    ddp_options = dict(ddp_options or {})
    if ddp_options and wrap is not None:
        raise InvalidArgument(f"ddp_options={ddp_options!r} is not allowed with wrap={wrappers['wrapper']!r}: expected "
                              "one of them (the wrap makes the model's DDP or FSDP itself: pass its options there)")
    unknown = sorted(set(ddp_options) - set(DDP_OPTIONS))
    if unknown:
        raise InvalidArgument(f"ddp_options: {unknown[0]!r} is not allowed: expected DistributedDataParallel options "
                              f"among {', '.join(DDP_OPTIONS)}")
    if syncs_per_step is not None:
        fields["syncs"] = syncs_per_step
    return ddp_step(world_size=world_size, fn=path, **wrappers, **ddp_options, **fields)
