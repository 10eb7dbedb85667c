"""equivcheck: prove that a way of training gives the same gradients and weights as full-batch training."""

from ._version import __version__

from .suites.audit import Audit, Finding, Sensitivity, audit
from .aggregation import MODES as AGGREGATIONS, Aggregated
from .case import Batch, Case, Objective, Term, default_optimizer
from .judge.verdict import Outcome, Report, Status, Verdict
from .check import check, check_all, regimes_for
from .diff import Comparison, Mismatch
from .judge.compare import compare
from .judge.hints import diagnose
from .errors import (BlindSpotWarning, CodeExited, EquivcheckError, EquivcheckWarning, InvalidArgument, IsolationWarning,
                     MemoryNotSaved, NonFinite, NotEquivalent, PrecisionWarning, ResultsNotWritten, RunDied, Unavailable, WorkerError)
from .device import DEVICES
from .precision import PRECISIONS, Precision, Tolerance, resolve_precision
from .regimes import DEFAULT_REGIMES, REGIMES, Pitfall, Regime, SummedLoss, parse_regime, register_regime
from .regimes.ddp_hooks import DdpHook
from .registry import all_cases, builtin_cases, get_case, load_cases_from, register_case
from .result import RunResult
from .runners.dispatch import run
from .evaluation import EvalReport, MetricDiff, check_eval
from .process.seeding import DEFAULT_SEED
from .team import Checkpoint, check_loop, check_step

__all__ = [
    "AGGREGATIONS", "DEFAULT_REGIMES", "DEFAULT_SEED", "DEVICES", "PRECISIONS", "REGIMES", "Aggregated", "Audit", "Batch",
    "BlindSpotWarning", "Case",
    "Checkpoint",
    "CodeExited", "Comparison", "DdpHook", "EquivcheckError", "EquivcheckWarning", "EvalReport", "Finding",
    "InvalidArgument", "IsolationWarning", "MemoryNotSaved", "MetricDiff", "Mismatch", "NonFinite", "NotEquivalent", "Objective", "Outcome",
    "Pitfall", "Precision", "PrecisionWarning", "Regime", "Report", "ResultsNotWritten", "RunDied", "RunResult", "Sensitivity",
    "Status", "SummedLoss", "Term", "Tolerance", "Unavailable", "Verdict", "WorkerError", "all_cases", "audit", "builtin_cases",
    "check", "check_all", "check_eval", "check_loop", "check_step", "compare", "default_optimizer", "diagnose",
    "get_case", "load_cases_from", "parse_regime", "regimes_for", "register_case", "register_regime", "resolve_precision", "run",
]
