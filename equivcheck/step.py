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

from .audit import warn_blind_spots
from .case import Case
from .check import Report, check
from .errors import InvalidArgument, expect_callable
from .regimes import Regime
from .seeding import DEFAULT_SEED
from .regimes.user_code import DdpStep, LoopFn, StepFn, UserLoop, UserStep, import_path


def check_step(
    case: Case | str,
    step: StepFn,
    reference: str | Regime | StepFn = "full_batch",
    *,
    world_size: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    **options,
) -> Report:
    """Check a team's ``step(model, optimizer, batch)`` against ``reference``: a regime spec, or another
    step function (the code before a refactor, or full batch with the same clipping).

    With ``world_size`` the step runs on that many DDP ranks of the warm pool (see ``regimes.user_code``),
    given the model in DistributedDataParallel, or what the team's ``wrap(model)`` makes of it (the
    trunk and the head each in DDP, say). ``options`` go to :func:`equivcheck.check` (rtol, atol, seed,
    backend, timeout).
    """
    reference = reference if isinstance(reference, (str, Regime)) else UserStep(reference)
    if world_size is None:
        if wrap is not None:
            raise InvalidArgument(f"wrap={wrap!r} is not allowed without world_size: expected world_size= with it "
                                  "(the model is wrapped for DDP ranks only)")
        candidate = UserStep(step)
    else:
        expect_callable("step", step)
        fn = import_path(step)
        if wrap is not None:
            expect_callable("wrap", wrap)
        candidate = DdpStep(world_size=world_size, fn=fn, wrapper="" if wrap is None else import_path(wrap, "wrap"))
    warn_blind_spots(case, seed=options.get("seed", DEFAULT_SEED))
    return check(case, [candidate], reference=reference, **options)


def check_loop(
    case: Case | str, loop: LoopFn, reference: str | Regime | LoopFn = "full_batch", **options
) -> Report:
    """Check a team's ``loop(model, optimizer, batches)`` against ``reference`` (a spec or another loop)."""
    reference = reference if isinstance(reference, (str, Regime)) else UserLoop(reference)
    warn_blind_spots(case, seed=options.get("seed", DEFAULT_SEED))
    return check(case, [UserLoop(loop)], reference=reference, **options)
