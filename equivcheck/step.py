"""The CI gate on a team's own training code: ``check_step`` and ``check_loop``.

``check_step(case, step)`` runs ``step(model, optimizer, (inputs, targets))`` once per global batch
of the case, from the same seeded start as the reference, and compares every gradient (taken when
the step calls ``optimizer.step()``), the final weights and the losses. ``check_loop`` does the
same for a function that runs a whole loop over the batches (schedulers and other state that lives
across steps belong there). The step returns the global batch's mean loss, or None to leave losses
out of the comparison.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer

from .audit import warn_blind_spots
from .case import Case
from .check import Report, check
from .errors import InvalidArgument, expect_callable
from .regimes import Regime
from .seeding import DEFAULT_SEED
from .regimes.ddp import DDP_OPTIONS
from .regimes.user_code import DdpLoop, DdpStep, LoopFn, StepFn, UserLoop, UserStep, import_path


def check_step(
    case: Case | str,
    step: StepFn,
    reference: str | Regime | StepFn = "full_batch",
    *,
    world_size: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    per_run: bool = False,
    ddp_options: dict | None = None,
    optimizer_wrap: Callable[[Optimizer], Optimizer] | None = None,
    **options,
) -> Report:
    """Check a team's ``step(model, optimizer, batch)`` against ``reference``: a regime spec, or another
    step function (the code before a refactor, or full batch with the same clipping). With ``per_run``,
    ``step`` is a factory called at the start of every run to make the step: a step that keeps state
    across calls (a GradScaler, a schedule) keeps it there, fresh for each run.

    With ``world_size`` the step runs on that many DDP ranks of the warm pool (see ``regimes.user_code``),
    given the model in DistributedDataParallel, or what the team's ``wrap(model)`` makes of it (the
    trunk and the head each in DDP, say), made with ``ddp_options`` (``{"find_unused_parameters": True}``;
    any of ``DistributedDataParallel``'s options that equivcheck's ddp regimes take), and handed the
    optimizer that the team's ``optimizer_wrap(optimizer)`` makes of the case's own (``ZeroRedundancyOptimizer``
    around it, as :func:`equivcheck.regimes.zero.sharded_like` builds it: its state sharded over the ranks,
    its broadcasts counted). ``wrap`` and ``optimizer_wrap`` must be module-level functions: the ranks import
    them by name. ``options`` go to :func:`equivcheck.check` (rtol, atol, seed, backend, timeout).
    """
    reference = reference if isinstance(reference, (str, Regime)) else UserStep(reference)
    if not isinstance(per_run, bool):
        raise InvalidArgument.type("per_run", per_run, "bool")
    ranks_only = {"wrap": wrap, "ddp_options": ddp_options, "optimizer_wrap": optimizer_wrap}
    candidate = (UserStep(step, per_run) if _in_process(world_size, **ranks_only)
                 else _on_ranks(DdpStep, "step", step, world_size, **ranks_only, per_run=per_run))
    warn_blind_spots(case, seed=options.get("seed", DEFAULT_SEED))
    return check(case, [candidate], reference=reference, **options)


def check_loop(
    case: Case | str,
    loop: LoopFn,
    reference: str | Regime | LoopFn = "full_batch",
    *,
    world_size: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    ddp_options: dict | None = None,
    optimizer_wrap: Callable[[Optimizer], Optimizer] | None = None,
    **options,
) -> Report:
    """Check a team's ``loop(model, optimizer, batches)`` against ``reference`` (a spec or another loop);
    with ``world_size``, the loop on that many DDP ranks, each given its shard of every global batch, the
    model in DDP made with ``ddp_options`` and the optimizer made by ``optimizer_wrap`` (as :func:`check_step`)."""
    reference = reference if isinstance(reference, (str, Regime)) else UserLoop(reference)
    ranks_only = {"wrap": wrap, "ddp_options": ddp_options, "optimizer_wrap": optimizer_wrap}
    candidate = (UserLoop(loop) if _in_process(world_size, **ranks_only)
                 else _on_ranks(DdpLoop, "loop", loop, world_size, **ranks_only))
    warn_blind_spots(case, seed=options.get("seed", DEFAULT_SEED))
    return check(case, [candidate], reference=reference, **options)


# Why each argument that only ranks take is refused without world_size.
_RANKS_ONLY = {"wrap": "the model is wrapped for DDP ranks only",
               "ddp_options": "the options are DistributedDataParallel's",
               "optimizer_wrap": "the optimizer is sharded over DDP ranks only"}


def _in_process(world_size: int | None, **ranks_only) -> bool:
    if world_size is None:
        for argument, value in ranks_only.items():
            if value:
                raise InvalidArgument(f"{argument}={value!r} is not allowed without world_size: expected world_size= "
                                      f"with it ({_RANKS_ONLY[argument]})")
    return world_size is None


def _on_ranks(regime: type[DdpStep], argument: str, fn: Callable, world_size: int, wrap: Callable | None,
              ddp_options: dict | None, optimizer_wrap: Callable | None, **fields) -> DdpStep:
    """The team's code on DDP ranks: it and its wraps travel by import path, which the ranks resolve."""
    expect_callable(argument, fn)
    path = import_path(fn, argument)
    wrappers = {}
    for name, field, given in (("wrap", "wrapper", wrap), ("optimizer_wrap", "optimizer_wrapper", optimizer_wrap)):
        if given is not None:
            expect_callable(name, given)
        wrappers[field] = "" if given is None else import_path(given, name)
    ddp_options = dict(ddp_options or {})
    unknown = sorted(set(ddp_options) - set(DDP_OPTIONS))
    if unknown:
        raise InvalidArgument(f"ddp_options: {unknown[0]!r} is not allowed: expected DistributedDataParallel options "
                              f"among {', '.join(DDP_OPTIONS)}")
    return regime(world_size=world_size, fn=path, **wrappers, **ddp_options, **fields)
