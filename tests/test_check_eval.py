"""Distributed evaluation, written as a team would: their metric over a DistributedSampler or their own
shards, all-reduced, against the same function in one process. Each bug beside its fixed twin."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

import equivcheck as ec


def make_model():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))


def make_data(samples):
    return torch.randn(samples, 5), torch.randint(0, 4, (samples,))


def loss_per_sample(logits, targets):
    return F.cross_entropy(logits, targets, reduction="none")


# 11 samples over 2 ranks: a DistributedSampler pads to 12, unpadded shards hold 6 and 5.
# Registered at the top level: the ranks import this module to find the case and the evaluate functions.
ELEVEN = ec.register_case(ec.Case(name="team_eval_eleven", model=make_model, data=lambda: make_data(11),
                                  loss=loss_per_sample, batch_size=11))
TWELVE = ec.register_case(ec.Case(name="team_eval_twelve", model=make_model, data=lambda: make_data(12),
                                  loss=loss_per_sample, batch_size=12))


def summed(model, loader):
    """Loss sum, correct predictions and sample count over a loader, as float64 for one all-reduce."""
    total = torch.zeros(3, dtype=torch.float64)
    for x, y in loader:
        logits = model(x)
        total += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                              (logits.argmax(1) == y).sum().double(), torch.tensor(float(len(y)))])
    return total


def my_shard(dataset):
    """This rank's samples, every W-th from its rank: no padding, uneven shards."""
    if not dist.is_initialized():
        return dataset
    return Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))


def evaluate_with_distributed_sampler(model, dataset):
    """Bug: the usual recipe, sums and counts all-reduced, over DistributedSampler's padded shards."""
    sampler = DistributedSampler(dataset, shuffle=False) if dist.is_initialized() else None
    total = summed(model, DataLoader(dataset, batch_size=4, sampler=sampler))
    if dist.is_initialized():
        dist.all_reduce(total)
    return {"loss": total[0] / total[2], "accuracy": total[1] / total[2]}


def evaluate_average_of_averages(model, dataset):
    """Bug: each rank's mean over its own unpadded shard, then the mean of those means."""
    loss, _, count = summed(model, DataLoader(my_shard(dataset), batch_size=4))
    mean = loss / count
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return {"loss": mean}


def evaluate_sums_and_counts(model, dataset):
    """Fixed: unpadded shards, the sums and the counts all-reduced, divided once."""
    total = summed(model, DataLoader(my_shard(dataset), batch_size=4))
    if dist.is_initialized():
        dist.all_reduce(total)
    return {"loss": total[0] / total[2], "accuracy": total[1] / total[2]}


def evaluate_without_all_reduce(model, dataset):
    """Bug: each rank's own mean, never combined."""
    loss, _, count = summed(model, DataLoader(my_shard(dataset), batch_size=4))
    return loss / count


def test_sums_and_counts_over_unpadded_shards_match_one_process():
    report = ec.check_eval(ELEVEN, evaluate_sums_and_counts, world_size=2)
    report.assert_equivalent()
    assert report.ok and report.margin < 1e-3 and {m.name for m in report.metrics} == {"loss", "accuracy"}


def test_distributed_sampler_padding_is_caught():
    report = ec.check_eval(ELEVEN, evaluate_with_distributed_sampler, world_size=2)
    loss = report.metric("loss")
    assert not report.ok and loss.margin > 1e3 and loss.ranks[0] == loss.ranks[1]  # all-reduced, still wrong
    assert "pads them to 12, repeating 1 sample(s)" in report.hint
    with pytest.raises(ec.NotEquivalent, match=r"'loss': .* in one process, .* on every rank: difference"):
        report.assert_equivalent()


def test_an_average_of_per_rank_averages_on_uneven_shards_is_caught():
    report = ec.check_eval(ELEVEN, evaluate_average_of_averages, world_size=2)
    assert not report.ok and report.metric("loss").margin > 1e3 and not report.problems
    assert "unpadded shards hold 5 to 6 samples" in report.hint


def test_a_metric_never_all_reduced_shows_as_ranks_that_disagree():
    report = ec.check_eval(ELEVEN, evaluate_without_all_reduce, world_size=2)
    assert not report.ok and report.metrics[0].name == "metric"
    assert any("ranks disagree on 'metric'" in p and "not all-reduced" in p for p in report.problems)


def test_an_even_split_is_blind_to_both_bugs_and_says_so():
    with pytest.warns(ec.BlindSpotWarning, match="12 samples, which divide evenly over 2 ranks") as seen:
        report = ec.check_eval(TWELVE, evaluate_with_distributed_sampler, world_size=2)
    assert seen[0].filename == __file__
    assert report.ok  # padding nothing: the bug cannot show here, hence the warning


def test_usage_errors():
    with pytest.raises(ec.InvalidArgument,
                       match=r"evaluate=.* is not allowed: expected a function, or an object bound to a name, at the top"):
        ec.check_eval(ELEVEN, lambda model, dataset: 0.0)
    with pytest.raises(ec.InvalidArgument, match=r"world_size=0 is not allowed"):
        ec.check_eval(ELEVEN, evaluate_sums_and_counts, world_size=0)
    with pytest.raises(ec.InvalidArgument, match=r"Expected a number .* but got the value evaluate returned="):
        ec.check_eval(ELEVEN, returns_text)


def returns_text(model, dataset):
    return "0.5"


def test_the_fixture_passes_the_fixed_evaluation(equivcheck):
    assert equivcheck.check_eval(ELEVEN, evaluate_sums_and_counts, world_size=2).ok


def test_the_fixture_fails_the_test_on_padding(pytester):
    pytester.makepyfile(test_padding="""
        from test_check_eval import ELEVEN, evaluate_with_distributed_sampler

        def test_eval(equivcheck):
            equivcheck.check_eval(ELEVEN, evaluate_with_distributed_sampler, world_size=2)
    """)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*pads them to 12, repeating 1 sample(s)*"])
