"""Cases a team writes every day under every rank regime: an optimizer that clips in a step hook, a frozen trunk, a
sparse embedding. Each is equivalent where the maths is, and the same case still catches a real bug."""

import pytest

import equivcheck as ec
from equivcheck import Verdict

import everyday_cases  # noqa: F401  (registers the cases)


def verdicts(case, regimes, **options):
    report = ec.check(case, regimes, **options)
    return {o.regime: o.verdict for o in report.outcomes}, report


def test_an_optimizer_clipping_in_a_step_hook_is_equivalent_under_zero_and_ddp():
    """ZeRO builds its own optimizer from the case's: the case's step hooks go with it (they stayed on the discarded
    one, and ZeRO stepped unclipped: margin 2.4e6)."""
    found, report = verdicts("clipped_by_hook", ["ddp:world_size=2", "zero:world_size=2", "naive_accumulate:chunks=8"])
    assert found == {"ddp:world_size=2": Verdict.EQUIVALENT, "zero:world_size=2": Verdict.EQUIVALENT,
                     "naive_accumulate:chunks=8": Verdict.MISMATCH}, [o.describe() for o in report.outcomes]


def test_a_team_optimizer_wrap_keeps_the_case_optimizers_step_hooks():
    from equivcheck.regimes.zero import with_step_hooks_of
    import torch

    case_optimizer = everyday_cases.sgd_clipping_in_a_hook(everyday_cases.mlp().parameters())
    made = torch.optim.SGD(everyday_cases.mlp().parameters(), lr=0.5)
    assert list(with_step_hooks_of(case_optimizer, made)._optimizer_step_pre_hooks.values()) == \
        list(case_optimizer._optimizer_step_pre_hooks.values())
    assert len(with_step_hooks_of(case_optimizer, made)._optimizer_step_pre_hooks) == 1  # never twice


@pytest.mark.parametrize("spec", ["fsdp:world_size=2", "fsdp_no_sync:world_size=2,chunks=2", "hsdp:replicate=1,shard=2"])
def test_a_frozen_trunk_under_fsdp2_counts_only_the_blocks_that_train(spec):
    """The frozen block has nothing to reduce-scatter: a faithful step syncs once, for the head (it was a
    communication verdict, 'a faithful step does it 2 time(s)')."""
    found, report = verdicts("frozen_trunk", [spec])
    assert found == {spec: Verdict.EQUIVALENT}, [o.describe() for o in report.outcomes]


def test_a_frozen_trunk_still_shows_a_sync_on_every_micro_batch():
    (outcome,) = ec.check("frozen_trunk", ["fsdp_sync_every_micro_batch:world_size=2,chunks=2"]).outcomes
    assert outcome.verdict is Verdict.COMMUNICATION, outcome.describe()
    assert "reduce-scattered gradients 2 time(s)" in outcome.comparison.problems[0]


def test_sparse_gradients_are_compared_as_the_dense_tensors_they_stand_for():
    """A sparse nn.Embedding's gradient (a recommender's habit) was an error everywhere, the harness's own arithmetic
    refusing the sparse layout; DDP synchronises sparse gradients over gloo."""
    found, report = verdicts("sparse_embedding", ["accumulate:chunks=2", "ddp:world_size=2", "naive_accumulate:chunks=8"])
    assert found == {"accumulate:chunks=2": Verdict.EQUIVALENT, "ddp:world_size=2": Verdict.EQUIVALENT,
                     "naive_accumulate:chunks=8": Verdict.MISMATCH}, [o.describe() for o in report.outcomes]


def test_an_optimizer_whose_step_calls_its_parents_steps_once_a_step_in_process_and_on_ranks():
    """Once an AdamW was made in the process, torch ran the step hooks of a subclass calling ``super().step()`` twice:
    the recording counted 6 steps for 3 and the schedule stepped twice a step (a false alarm on the team's own
    optimizer). Only the outermost step is counted now; the same case still catches a bug."""
    found, report = verdicts("subclassed_adamw", ["accumulate:chunks=3", "ddp:world_size=2", "zero:world_size=2",
                                                  "naive_accumulate:chunks=5"])
    assert found == {"accumulate:chunks=3": Verdict.EQUIVALENT, "ddp:world_size=2": Verdict.EQUIVALENT,
                     "zero:world_size=2": Verdict.EQUIVALENT, "naive_accumulate:chunks=5": Verdict.MISMATCH}, \
        [o.describe() for o in report.outcomes]
    assert all(o.result.optimizer_steps == 3 for o in report.outcomes if o.result is not None)
