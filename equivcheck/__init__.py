"""equivcheck: prove that a way of training gives the same gradients and weights as full-batch training."""

from ._version import __version__

from .suites.audit import Audit, Finding, Sensitivity, audit
from .case import Batch, Case, Objective, default_optimizer
from .check import Outcome, Report, Verdict, check, check_all, regimes_for
from .diff import Comparison, Mismatch
from .judge.compare import compare
from .judge.hints import diagnose
from .errors import (BlindSpotWarning, EquivcheckError, InvalidArgument, MemoryNotSaved, NotEquivalent,
                     PrecisionWarning, Unavailable, WorkerError)
from .precision import PRECISIONS, Precision, Tolerance
from .regimes import DEFAULT_REGIMES, REGIMES, Regime, SummedLoss, parse_regime, register_regime
from .registry import all_cases, builtin_cases, get_case, load_cases_from, register_case
from .result import RunResult
from .runners.dispatch import run
from .evaluation import EvalReport, MetricDiff, check_eval
from .process.seeding import DEFAULT_SEED
from .team import check_loop, check_step

__all__ = [
    "DEFAULT_REGIMES", "DEFAULT_SEED", "PRECISIONS", "REGIMES", "Audit", "Batch", "BlindSpotWarning", "Case",
    "Comparison", "EquivcheckError", "EvalReport", "Finding", "InvalidArgument", "MemoryNotSaved", "MetricDiff", "Mismatch", "NotEquivalent",
    "Objective", "Outcome", "Precision", "PrecisionWarning", "Regime", "Report", "RunResult", "Sensitivity",
    "SummedLoss", "Tolerance", "Unavailable", "Verdict", "WorkerError", "all_cases", "audit", "builtin_cases",
    "check", "check_all", "check_eval", "check_loop", "check_step", "compare", "default_optimizer", "diagnose", "get_case",
    "load_cases_from", "parse_regime", "regimes_for", "register_case", "register_regime", "run",
]
