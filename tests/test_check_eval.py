"""Distributed evaluation, written as a team would: their metric over a DistributedSampler or their own
shards, all-reduced, against the same function in one process. Each bug beside its fixed twin."""

import time

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


def evaluate_slowly(model, dataset):
    """Fixed, and slow on ranks: a second before each batch of two, three batches a rank."""
    def slow(x):
        if dist.is_initialized():
            time.sleep(1.0)
        return model(x)

    total = summed(slow, DataLoader(my_shard(dataset), batch_size=2))
    if dist.is_initialized():
        dist.all_reduce(total)
    return {"loss": total[0] / total[2], "accuracy": total[1] / total[2]}


def test_an_evaluation_longer_than_its_timeout_that_keeps_calling_its_model_is_judged_not_called_a_hang():
    """An evaluation takes no optimizer step: each call of the model is its progress."""
    started = time.monotonic()
    report = ec.check_eval(ELEVEN, evaluate_slowly, world_size=2, timeout=2)
    assert report.ok, report.describe()
    assert time.monotonic() - started > 3  # it did outlast its timeout


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


def evaluate_dropping_the_last_batch(model, dataset):
    """Bug: sums and counts all-reduced over unpadded shards whose loaders drop their last short batch."""
    total = summed(model, DataLoader(my_shard(dataset), batch_size=4, drop_last=dist.is_initialized()))
    if dist.is_initialized():
        dist.all_reduce(total)
    return {"loss": total[0] / total[2], "accuracy": total[1] / total[2]}


def evaluate_with_other_weights_on_rank_1(model, dataset):
    """Bug: rank 1 evaluates weights of its own (a checkpoint it loaded late, an average it never swapped in)."""
    if dist.is_initialized() and dist.get_rank() == 1:
        model[0].bias.add_(0.01)
    return evaluate_sums_and_counts(model, dataset)


def evaluate_on_scaled_inputs(model, dataset):
    """The team's code scales every sample before the model sees it: its calls read back to no sample."""
    total = torch.zeros(3, dtype=torch.float64)
    for x, y in DataLoader(my_shard(dataset), batch_size=4):
        logits = model(x * 2)
        total += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum().double(),
                              torch.tensor(float(len(y)))])
    if dist.is_initialized():
        total[0] *= 1.5  # and a bug of its own on the ranks
        dist.all_reduce(total)
    return {"loss": total[0] / total[2]}


def test_where_a_metric_parts_is_said_from_the_samples_the_model_was_fed_and_what_it_output():
    """After the model (every sample evaluated, every output alike: the metric), in its forward (a sample no rank
    evaluated, an output computed otherwise), or not said where the model's calls do not read back to samples."""
    padded = ec.check_eval(ELEVEN, evaluate_with_distributed_sampler, world_size=2).location
    assert padded.phase == "metric" and padded.step is None, padded
    assert "1 evaluated more often than in one process (sample 0: a sampler's padding" in padded.matched
    averaged = ec.check_eval(ELEVEN, evaluate_average_of_averages, world_size=2).location
    assert averaged.phase == "metric" and "more often" not in averaged.matched, averaged
    dropped = ec.check_eval(ELEVEN, evaluate_dropping_the_last_batch, world_size=2).location
    assert (dropped.phase, dropped.tensor) == ("forward", "the samples the model was fed"), dropped
    assert "3 of the samples one process evaluates no rank evaluated (sample 8, sample 9, sample 10)" in dropped.matched
    other = ec.check_eval(ELEVEN, evaluate_with_other_weights_on_rank_1, world_size=2).location
    assert (other.phase, other.tensor) == ("forward", "the model's output for sample 1 on rank 1"), other
    assert other.margin > 1e3 and "fed the same sample, the model computed otherwise" in other.matched
    scaled = ec.check_eval(ELEVEN, evaluate_on_scaled_inputs, world_size=2)
    assert scaled.location is None and not scaled.ok
    assert scaled.unlocated == ("not said: on one process, the model was fed a row the dataset does not hold (the "
                                "team's code changed its samples)")
    assert "where: not said: on one process" in scaled.describe()
    assert ec.check_eval(ELEVEN, evaluate_sums_and_counts, world_size=2).location is None  # the twin: nothing parts


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


def test_an_output_digest_parts_only_where_its_rows_part_beyond_what_the_tolerance_allows_their_sums():
    """Outputs too large to keep whole (an LM's logits) are kept as three sums each: rows within the tolerance
    elementwise never part, a row whose sums part beyond it does, and a digest of another size is apart whatever its
    sums. (One element off by less than the whole row's allowance is not seen: the location then says digests.)"""
    from equivcheck.judge.eval_location import _apart, digests

    tolerance = ec.Tolerance(1e-7, 1e-7)
    rows = torch.randn(4, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    within = rows + (tolerance.atol + tolerance.rtol * rows.abs()) * torch.sign(torch.randn(4, 1000))
    beyond = rows.clone()
    beyond[2] += 1e-5
    expected = digests(rows)
    assert all(_apart(a, e, tolerance) <= 1 for a, e in zip(digests(within), expected))
    assert [_apart(a, e, tolerance) > 1 for a, e in zip(digests(beyond), expected)] == [False, False, True, False]
    assert _apart(digests(rows[:1, :999])[0], expected[0], tolerance) == float("inf")


def test_a_side_past_its_budget_keeps_every_output_as_its_digest(monkeypatch):
    from torch.utils.data import TensorDataset

    from equivcheck.judge.eval_location import digests
    from equivcheck.runners import evaluate

    monkeypatch.setattr(evaluate, "KEPT_WHOLE", 10)
    inputs = torch.arange(8.0).reshape(4, 2)
    seen = evaluate.SamplesSeen(TensorDataset(inputs, torch.zeros(4)))
    seen.called((inputs[:2],), {}, torch.ones(2, 4))
    assert "outputs" in seen.result()
    seen.called((inputs[2:],), {}, torch.ones(2, 4))
    assert seen.result()["digests"] == digests(torch.ones(4, 4))


def test_a_call_that_cannot_be_read_back_leaves_the_evaluation_unlocated_and_running(monkeypatch):
    from torch.utils.data import TensorDataset

    from equivcheck.runners import evaluate

    def unreadable(rows):
        raise RuntimeError("a layout the reader does not know")

    inputs = torch.arange(8.0).reshape(4, 2)
    seen = evaluate.SamplesSeen(TensorDataset(inputs, torch.zeros(4)))
    monkeypatch.setattr(evaluate, "_keys", unreadable)
    seen.called((inputs,), {}, torch.ones(4, 3))
    assert seen.result() == {"unread": "the model's calls could not be read back to samples (RuntimeError: a layout "
                                       "the reader does not know)"}


CALLS = [0]  # evaluations in this process (each rank's process keeps its own count)


def evaluate_differently_each_time(model, dataset):
    """Not deterministic: each call's metric moves with how many came before it (a team's cache, a drifting seed)."""
    CALLS[0] += 1
    return evaluate_sums_and_counts(model, dataset)["loss"] + 0.01 * CALLS[0] * (1 + dist.is_initialized())


def test_an_evaluation_that_gives_other_metrics_when_evaluated_again_is_left_unlocated():
    """Where it parts is read from a second evaluation that records the samples; one whose metrics came out otherwise
    the second time cannot say where the first parted, and says so."""
    report = ec.check_eval(ELEVEN, evaluate_differently_each_time, world_size=2)
    assert not report.ok and report.location is None
    assert report.unlocated == ("not said: evaluated again to record its samples, it gave other metrics than the first "
                                "time")
