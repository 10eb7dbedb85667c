"""What the ranks are asked to do: typed jobs of plain data, each of which answers itself on a rank.

A job crosses to the ranks pickled, as names (a case's, where to import it from, a regime's spec, a team
function's import path), never as objects; a rank imports what the names say and replies with plain data
(numpy arrays, never shared-memory tensors, which break once their sender exits).
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
import torch.distributed as dist

from ...process.import_paths import resolve
from ...regimes import parse_regime, regime_source
from ...registry import load_case
from ..evaluate import evaluate
from ..request import RunRequest
from ..train import run_request
from . import shared_reference


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """Train one run on every rank of an initialised process group; each rank replies with its run as plain data."""

    case: str
    source: str  # where a rank imports the case from: a module name or a file, or module:NAME of the case itself
    regime: str  # the regime's spec
    regime_source: str  # the module that registers the regime's name
    request: dict  # the rest of the run's request, checked where it was made (RunRequest.plain)
    against: dict | None = None  # the reference to compare with as it trains: a file each rank maps, a tolerance

    @classmethod
    def of(cls, request: RunRequest, source: str, against: dict | None = None) -> TrainJob:
        return cls(request.case.name, source, str(request.regime), regime_source(request.regime), request.plain(),
                   against)

    def describe(self) -> str:
        return f"job {self.case} under {self.regime}"

    def answer(self) -> dict:
        """The case's module and the regime's are imported first: they register the names the job uses."""
        case = load_case(self.case, self.source)
        importlib.import_module(self.regime_source)
        request = RunRequest.rebuilt(case, parse_regime(self.regime), self.request)
        against = None if self.against is None else shared_reference.expected(self.against)
        return run_request(request, against).to_plain()


@dataclasses.dataclass(frozen=True)
class EvalJob:
    """Evaluate a team's function on every rank (its sampler and its all-reduce decide what each sees); each rank
    replies with its metrics and the number of samples the data holds."""

    case: str
    source: str
    fn: str  # the evaluation function's import path
    seed: int
    records: bool = False  # and the samples its model's calls were fed (a failed check's second evaluation)

    def describe(self) -> str:
        return f"job {self.case} under evaluate:{self.fn}"

    def answer(self) -> dict:
        case = load_case(self.case, self.source)
        device = (torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
                  if dist.get_backend() == "nccl" else None)
        return evaluate(case, resolve(self.fn), seed=self.seed, device=device, records=self.records)


Job = TrainJob | EvalJob
