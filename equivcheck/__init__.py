"""equivcheck: prove that a way of training gives the same gradients and weights as full-batch training."""

from . import ddp_regimes  # noqa: F401  (registers the distributed regimes)
from .case import Batch, Case, Objective, default_optimizer
from .check import Outcome, Report, Verdict, check, check_all, regimes_for
from .compare import Comparison, Mismatch, Tolerance, compare
from .errors import EquivcheckError, InvalidArgument, NotEquivalent, Unavailable, WorkerError
from .regimes import DEFAULT_REGIMES, REGIMES, Regime, parse_regime
from .registry import all_cases, get_case, load_cases_from, register_case
from .result import RunResult
from .execute import run
from .seeding import DEFAULT_SEED
from .step import check_loop, check_step

__all__ = [
    "DEFAULT_REGIMES", "DEFAULT_SEED", "REGIMES", "Batch", "Case", "Comparison", "EquivcheckError",
    "InvalidArgument", "Mismatch", "NotEquivalent", "Objective", "Outcome", "Regime", "Report", "RunResult",
    "Tolerance", "Unavailable", "Verdict", "WorkerError", "all_cases", "check", "check_all", "check_loop",
    "check_step", "compare", "default_optimizer", "get_case", "load_cases_from", "parse_regime", "regimes_for",
    "register_case", "run",
]
