"""End-of-epoch bugs, written as a team would: a loop that owns its DataLoader (drop_last=False) over data
whose last global batch is smaller, for two epochs. Each bug beside its fixed twin."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import equivcheck as ec
from equivcheck import Verdict

MICRO, K = 2, 4  # the loop's DataLoader yields micro-batches of 2; it steps every 4: global batches of 8


def make_model():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_data(samples=27):
    return torch.randn(samples, 6), torch.randint(0, 3, (samples,))


def loss_per_sample(logits, targets):
    return F.cross_entropy(logits, targets, reduction="none")


# 27 samples: global batches of 8, 8, 8 and 3 (micro-batches 2, 1 in the last window), twice over.
# Registered at the top level: DDP ranks import this module to find the cases.
TAIL = ec.register_case(ec.Case(name="team_epoch_tail", model=make_model, data=make_data, loss=loss_per_sample,
                                batch_size=K * MICRO, steps=4, last_batch="keep", epochs=2))
ONE_EPOCH = ec.register_case(ec.Case(name="team_epoch_tail_once", model=make_model, data=make_data,
                                     loss=loss_per_sample, batch_size=K * MICRO, steps=4, last_batch="keep"))
# 17 samples: the last global batch holds 1 sample, fewer than 2 ranks: one rank's shard is empty.
ONE_SAMPLE_TAIL = ec.register_case(ec.Case(name="team_one_sample_tail", model=make_model,
                                           data=lambda: make_data(17), loss=loss_per_sample,
                                           batch_size=K * MICRO, steps=3, last_batch="keep"))


def windows(loader):
    """(micro-batch, samples in its window, last of its window) for each micro-batch of one epoch."""
    total = len(loader.dataset)
    for i, (x, y) in enumerate(loader):
        in_window = min(K * MICRO, total - i // K * K * MICRO)
        yield x, y, in_window, (i + 1) % K == 0 or i + 1 == len(loader)


def train_loop(model, optimizer, batches):
    """The fixed loop: each micro-batch's loss sum over its window's samples, a step after every window."""
    loader = DataLoader(batches.dataset, batch_size=MICRO, drop_last=False)
    for _ in range(batches.epochs):
        for x, y, in_window, last in windows(loader):
            (F.cross_entropy(model(x), y, reduction="sum") / in_window).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()


def loop_dividing_by_k(model, optimizer, batches):
    """Bug: micro-batch mean / K, right for full windows of equal micro-batches, wrong for the smaller last one."""
    loader = DataLoader(batches.dataset, batch_size=MICRO, drop_last=False)
    for _ in range(batches.epochs):
        for x, y, _, last in windows(loader):
            (F.cross_entropy(model(x), y) / K).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()


def loop_dividing_by_batch_size(model, optimizer, batches):
    """Bug: the loss sum over the full batch size, a constant: the last, smaller window's gradient shrinks."""
    loader = DataLoader(batches.dataset, batch_size=MICRO, drop_last=False)
    for _ in range(batches.epochs):
        for x, y, _, last in windows(loader):
            (F.cross_entropy(model(x), y, reduction="sum") / (K * MICRO)).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()


def loop_stepping_full_windows_only(model, optimizer, batches):
    """Bug: `if (i + 1) % K == 0` only: the last, partial window is never stepped."""
    loader = DataLoader(batches.dataset, batch_size=MICRO, drop_last=False)
    for _ in range(batches.epochs):
        for i, (x, y, in_window, _) in enumerate(windows(loader)):
            (F.cross_entropy(model(x), y, reduction="sum") / in_window).backward()
            if (i + 1) % K == 0:
                optimizer.step()
                optimizer.zero_grad()


def loop_leaking_the_tail(model, optimizer, batches):
    """Bug: the partial window is flushed with a step after the epoch, but never zeroed: its gradients
    join the next epoch's first window."""
    loader = DataLoader(batches.dataset, batch_size=MICRO, drop_last=False)
    for _ in range(batches.epochs):
        for i, (x, y, in_window, _) in enumerate(windows(loader)):
            (F.cross_entropy(model(x), y, reduction="sum") / in_window).backward()
            if (i + 1) % K == 0:
                optimizer.step()
                optimizer.zero_grad()
        if len(loader) % K:
            optimizer.step()  # the flush, without optimizer.zero_grad()


def test_the_fixed_loop_matches_full_batch_over_the_tail_and_both_epochs():
    report = ec.check_loop(TAIL, train_loop)
    report.assert_equivalent()
    assert report.outcomes[0].result.optimizer_steps == 8  # 4 global batches, twice


@pytest.mark.parametrize("loop", [loop_dividing_by_k, loop_dividing_by_batch_size])
def test_the_last_smaller_window_weighted_as_a_full_one_is_caught(loop):
    (outcome,) = ec.check_loop(TAIL, loop).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert outcome.comparison.first_divergent_step == 3  # the first epoch's last, smaller global batch
    assert outcome.comparison.margin > 1e3


def test_a_partial_window_never_stepped_is_caught():
    (outcome,) = ec.check_loop(ONE_EPOCH, loop_stepping_full_windows_only).outcomes
    assert outcome.verdict is Verdict.MISMATCH
    assert "optimizer steps: the reference took 4, the candidate 3" in outcome.comparison.problems
    assert "3 optimizer steps where the reference took 4" in outcome.comparison.hint


def test_tail_gradients_leaking_into_the_next_epoch_are_caught():
    (outcome,) = ec.check_loop(TAIL, loop_leaking_the_tail).outcomes
    assert outcome.verdict is Verdict.MISMATCH and not outcome.comparison.problems  # 8 steps, as the reference
    assert outcome.comparison.first_divergent_step == 4  # the second epoch's first step carries the tail's grads
    # The one-epoch case cannot show it: the leak needs a next epoch.
    ec.check_loop(ONE_EPOCH, loop_leaking_the_tail).assert_equivalent()


def global_batch_step(model, optimizer, batch):
    """The fixed step: loss sum over this batch's own size."""
    inputs, targets = batch
    for x, y in zip(inputs.split(MICRO), targets.split(MICRO)):
        (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
    optimizer.step()
    optimizer.zero_grad()


def step_dividing_by_batch_size(model, optimizer, batch):
    """Bug: the loss sum over the configured batch size, wrong for the smaller last batch."""
    inputs, targets = batch
    for x, y in zip(inputs.split(MICRO), targets.split(MICRO)):
        (F.cross_entropy(model(x), y, reduction="sum") / (K * MICRO)).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_step_is_checked_on_the_smaller_last_batch_of_every_epoch():
    ec.check_step(TAIL, global_batch_step).assert_equivalent()
    (outcome,) = ec.check_step(TAIL, step_dividing_by_batch_size).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 3


def test_every_default_regime_handles_the_tail():
    report = ec.check(TAIL)
    report.assert_equivalent()
    verdicts = {o.regime: o.verdict for o in report.outcomes}
    assert verdicts.pop("data_parallel") in (Verdict.EQUIVALENT, Verdict.SKIPPED)  # skipped without 2 GPUs
    assert set(verdicts) == {"full_batch", "sample_by_sample", "accumulate:chunks=5", "retained_graph:chunks=5",
                             "ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=3"}
    assert set(verdicts.values()) == {Verdict.EQUIVALENT}


def test_naive_scaling_with_equal_chunks_is_caught_by_the_tail_alone():
    """mean / K over 4 equal chunks of 2 is exact on full batches: only the 3-sample tail shows it."""
    exact = ec.check(ec.get_case("mlp"), ["naive_accumulate:chunks=4"], rtol=1e-7, atol=1e-7)
    assert exact.outcomes[0].verdict is Verdict.EQUIVALENT
    (outcome,) = ec.check(TAIL, ["naive_accumulate:chunks=4"]).outcomes
    assert outcome.verdict is Verdict.MISMATCH and outcome.comparison.first_divergent_step == 3


def test_an_empty_ddp_shard_joins_the_all_reduce_with_a_zero_gradient():
    report = ec.check(ONE_SAMPLE_TAIL, ["ddp:world_size=2", "ddp_no_sync:world_size=2,chunks=2"])
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT, Verdict.EQUIVALENT]
    assert report.outcomes[0].result.batch_samples == (8, 8, 1)


def test_a_teams_ddp_step_is_never_handed_an_empty_shard():
    with pytest.raises(ec.InvalidArgument, match=r"a global batch of 1 sample\(s\) .* world_size=2"):
        ec.check_step(ONE_SAMPLE_TAIL, global_batch_step, world_size=2)


def test_data_sizes_and_values_that_are_refused():
    """The strict default still names the rule, and last_batch='keep' names the steps that fit."""
    strict = ec.Case(name="strict_tail", model=make_model, data=lambda: make_data(27), loss=loss_per_sample,
                     batch_size=8, steps=3)
    with pytest.raises(ec.InvalidArgument, match=r"holds 27 samples: expected exactly .* = 24 .*last_batch='keep'"):
        ec.run(strict, "full_batch")
    kept = ec.Case(name="kept_tail", model=make_model, data=lambda: make_data(27), loss=loss_per_sample,
                   batch_size=8, steps=3, last_batch="keep")
    with pytest.raises(ec.InvalidArgument, match=r"expected 17 to 24: .* 27 samples make 4 global batches: declare steps=4"):
        ec.run(kept, "full_batch")
    with pytest.raises(ec.InvalidArgument, match=r"last_batch='drop' is not allowed: expected 'exact' or 'keep'"):
        ec.Case(name="x", model=make_model, data=make_data, loss=loss_per_sample, batch_size=8, last_batch="drop")
    with pytest.raises(ec.InvalidArgument, match=r"epochs=0 is not allowed"):
        ec.Case(name="x", model=make_model, data=make_data, loss=loss_per_sample, batch_size=8, epochs=0)


@pytest.mark.parametrize("loop, says", [
    (loop_dividing_by_k, "until step 3, an epoch's last, smaller global batch (3 of 8 samples): likely that batch "
                         "weighted as a full one"),
    (loop_leaking_the_tail, "until step 4, the first after an epoch's last, smaller global batch (step 3, which "
                            "matches): likely that partial window's gradients left in .grad into the next epoch"),
])
def test_the_hint_names_the_tail(loop, says):
    (outcome,) = ec.check_loop(TAIL, loop).outcomes
    assert says in outcome.comparison.hint
