"""A regime of a team's own is one new module: it runs in-process, on the pool and in the catalogue."""

from equivcheck import Verdict, check
from equivcheck.catalogue import Entry, run_catalogue, targets_met

import own_regime  # noqa: F401  (registers the regimes and their case; the ranks import it by name)


def test_a_regime_from_one_module_runs_in_process_and_on_the_pool():
    # A built-in case: the ranks learn the regime from its own module, not from the case's.
    report = check("mlp", ["reversed_accumulate:chunks=3", "ddp_halved_loss:world_size=2", "accumulate:chunks=3"])
    verdicts = [(o.regime, o.verdict) for o in report.outcomes]
    assert verdicts == [("reversed_accumulate:chunks=3", Verdict.EQUIVALENT),
                        ("ddp_halved_loss:world_size=2", Verdict.MISMATCH),
                        ("accumulate:chunks=3", Verdict.EQUIVALENT)]
    halved = report.outcomes[1].comparison
    assert halved.margin > 1e3 and halved.first_divergent_step == 0


def test_a_regime_from_one_module_takes_its_row_in_the_catalogue():
    entry = Entry("loss halved again under DDP", "own_regime_mlp", "ddp_halved_loss:world_size=2", "ddp:world_size=2")
    (row,) = run_catalogue(["float64"], [entry])
    assert row.caught and row.twin.verdict is Verdict.EQUIVALENT and targets_met([row])
