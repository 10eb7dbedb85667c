"""Run the peer trainparity on bench/peer_case.py (in the peer's venv): verdicts and seconds per check as JSON.

``correct``: 4 micro-batches, one step. ``buggy``: clip_grad_norm_ after every micro-batch's backward instead
of once before the step (equivcheck's clip_per_micro_batch; trainparity's full-batch control clips once).
Tolerance: equivcheck's float64 one (rtol = atol = 1e-7).
"""

import json
import sys
import time
from pathlib import Path

from trainparity.api import AccumulationExecutionPlan, ToleranceComparison, check_accumulation

MAX_NORM = 0.1  # as in equivcheck's cases/clipping.py; the first partial sums clip, so the bug shows
PLANS = {
    "correct": AccumulationExecutionPlan(4),
    "buggy": AccumulationExecutionPlan(4, clip_grad_norm=MAX_NORM, clip_per_microbatch=True),
}


def main(plans: list[str]) -> None:
    here = Path(__file__).resolve().parent
    rows = []
    for name in plans:
        started = time.perf_counter()
        result = check_accumulation("peer_case:MlpCase", candidate=PLANS[name],
                                    comparison=ToleranceComparison(rtol=1e-7, atol=1e-7),
                                    cwd=here, environment={"PYTHONPATH": str(here)})
        rows.append({"plan": name, "outcome": result.outcome.value, "seconds": time.perf_counter() - started,
                     "phase": result.first_observed_phase, "message": result.message})
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:] or ["correct"])
