"""Dropout on ranks: every rank draws the global batch's masks and applies its own part, so a case with dropout (and
dropout inside checkpointed blocks) matches one process under DDP, FSDP2, ZeRO, TP and FSDP2 x TP; with the alignment
taken out the same check fails, and what cannot be placed is an error that says why."""

import re

import pytest
import torch

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.regimes.aligned_dropout import rows_in

RANKS = ["ddp:world_size=2", "ddp:world_size=5", "ddp_no_sync:world_size=2,chunks=3", "fsdp:world_size=2",
         "fsdp_no_sync:world_size=2,chunks=2", "zero:world_size=3", "hsdp:replicate=2,shard=2", "tp:world_size=2",
         "fsdp_tp:dp=2,tp=2"]


@pytest.mark.parametrize("case", ["dropout_two_layers", "checkpointed_dropout"])
def test_dropout_on_ranks_matches_one_process(case):
    report = ec.check(case, RANKS, dtype=torch.float64)
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * len(RANKS), [o.describe() for o in report.outcomes]


def test_dropout_on_sequence_shards_matches_one_process():
    """Under sequence parallelism dropout runs on DTensors sharded on the sequence (the norm's output, the rowwise
    Linear's): each rank applies its sequence slice of the global masks, on 2 and 4 ranks and on a 2 x 2 mesh."""
    from dropout_cases import SEQUENCE_DROPOUT

    regimes = ["tp_sp:world_size=2", "tp_sp:world_size=4", "fsdp_tp_sp:dp=2,tp=2", "ddp:world_size=2"]
    report = ec.check(SEQUENCE_DROPOUT, regimes)
    assert [o.verdict for o in report.outcomes] == [Verdict.EQUIVALENT] * len(regimes), [o.describe() for o in report.outcomes]


def test_a_teams_own_ddp_step_on_a_case_with_dropout_matches_one_process():
    """The team's step calls the model on the shard it is handed (a view of the global batch): its dropout is placed."""
    import mesh_team
    from dropout_cases import UNDECLARED

    (outcome,) = ec.check_step(UNDECLARED, mesh_team.train_step, world_size=2).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


def test_without_the_global_masks_the_same_check_fails():
    """The guard taken out (tests/dropout_cases.py's ddp_unaligned: each rank draws its shard's masks as they come):
    the same case, the same check, a mismatch from the first step's loss."""
    from dropout_cases import UNDECLARED

    aligned, unaligned = ec.check(UNDECLARED, ["ddp:world_size=2", "ddp_unaligned:world_size=2"]).outcomes
    assert aligned.verdict is Verdict.EQUIVALENT, aligned.describe()
    assert unaligned.verdict is Verdict.MISMATCH and unaligned.comparison.margin > 1e4, unaligned.describe()


def test_a_tp_group_seeded_apart_is_caught_and_its_replicas_drift():
    from dropout_cases import UNDECLARED

    (seeded,) = ec.check(UNDECLARED, ["tp_dropout_rank_seeded:world_size=2"]).outcomes
    assert seeded.verdict is Verdict.MISMATCH and seeded.comparison.margin > 1e4, seeded.describe()
    assert "rank 1 against rank 0" in seeded.describe()
    assert "dropout masks" in seeded.comparison.hint  # the tensor-parallel reading, not DDP's
    assert ec.REGIMES["tp_dropout_rank_seeded"].pitfall.twin_of("tp_dropout_rank_seeded:world_size=2") == \
        ec.parse_regime("tp:world_size=2")


def test_micro_batches_under_accumulation_in_one_process_still_draw_their_own_masks():
    """Only ranks are aligned: in one process, accumulation over two dropout layers stays the pitfall it is."""
    from dropout_cases import UNDECLARED

    (accumulated,) = ec.check(UNDECLARED, ["accumulate:chunks=4"]).outcomes
    assert accumulated.verdict is Verdict.MISMATCH


@pytest.mark.parametrize("case, regime, words", [
    ("dropout_batch_second", "ddp:world_size=2", r"an input of shape \(10, 6\) does not hold this forward's 6 rows "
                                                 r"of the global batch on dim 0"),
    ("dropout_in_attention_kernel", "ddp:world_size=2", r"scaled_dot_product_attention\(dropout_p=0.1\) draws its mask "
                                                r"inside the attention kernel"),
    ("dropout_two_layers", "ddp_padded_sampler:world_size=5", r"this forward's inputs are no slice of a global "
                                                              r"batch"),
])
def test_dropout_that_cannot_be_placed_is_an_error_saying_why(case, regime, words):
    import dropout_cases  # noqa: F401  (registers the cases)

    (outcome,) = ec.check(case, [regime]).outcomes
    assert outcome.verdict is Verdict.ERROR, outcome.describe()
    assert re.search(words, outcome.reason), outcome.reason


def test_attention_without_dropout_runs_on_ranks_as_before():
    from dropout_cases import ATTENTION

    (outcome,) = ec.check(ATTENTION, ["ddp:world_size=2"]).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()


def test_a_forward_finds_its_rows_in_the_global_batch():
    whole = torch.arange(24.0).view(12, 2)
    shards = whole.tensor_split(5)
    assert [rows_in(shard, [whole]) for shard in shards] == [(0, 3, 12), (3, 3, 12), (6, 2, 12), (8, 2, 12),
                                                             (10, 2, 12)]
    micro = shards[1].tensor_split(2)[1]
    assert rows_in(micro, [torch.zeros(3, 2), whole]) == (5, 1, 12)
    assert rows_in(whole, [whole]) == (0, 12, 12)
    assert rows_in(shards[1].clone(), [whole]) is None  # a copy: nobody can tell
    assert rows_in(whole[:, :1], [whole]) is None  # columns: no rows of it
    assert rows_in(whole[::2], [whole]) is None  # every other row: no contiguous slice
    assert rows_in("tokens", [whole]) is None
