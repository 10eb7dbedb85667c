"""A regime of a team's own is one new module: it runs in-process, on the pool and in the catalogue."""

import dataclasses

import pytest

from equivcheck import InvalidArgument, Verdict, check
from equivcheck.suites.catalogue import Entry, run_catalogue, targets_met
from equivcheck.regimes import Chunked, accumulate, register_regime

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


@dataclasses.dataclass(frozen=True)
class CountlessAccumulate(Chunked):
    """Declares DDP's one gradient sync per step but runs in-process: nothing wraps the model, nothing is counted.
    Not registered: a test's regime in the registry would change the list every unknown-regime error prints."""

    name = "countless_accumulate"
    summary = "accumulate in-process while declaring one gradient sync per step"
    syncs_per_step = 1

    def train_step(self, model, optimizer, batch, objective):
        return accumulate(model, optimizer, batch, objective, self.chunks)


def test_a_declared_sync_count_is_held_to_only_where_the_run_counted_syncs():
    (outcome,) = check("mlp", [CountlessAccumulate(3)]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.result.syncs is None
    assert outcome.comparison.problems == ()


def test_a_second_regime_under_a_taken_name_is_refused_naming_both():
    taken = type("Taken", (CountlessAccumulate,), {"name": "reversed_accumulate"})
    with pytest.raises(InvalidArgument) as refused:
        register_regime(taken)
    assert str(refused.value) == ("name='reversed_accumulate' is not allowed: expected a regime name not registered "
                                  "yet (it names own_regime.ReversedAccumulate)")
    assert check("mlp", ["reversed_accumulate:chunks=3"]).ok  # the first keeps its name
