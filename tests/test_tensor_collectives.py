"""What tensor parallelism communicates per optimizer step, by kind and mesh dimension (``"all_reduce[tp]"``), counted
where DTensor's functional collectives and FSDP2's c10d calls reach the dispatcher: measured on tp_mlp (6-16-3 GELU
MLP, colwise then rowwise, batches of 12 in float64) on 2 gloo ranks and on a 2 x 2 mesh, and a planted collective
showing up in the count. The harness's read-back (``full_tensor``, for the report) is not counted."""

import pytest

import equivcheck as ec
from equivcheck import Verdict
from equivcheck.render.rows import to_rows

TP, FSDP_TP, PLANTED = "tp:world_size=2", "fsdp_tp:dp=2,tp=2", "tp_extra_gather:world_size=2"
F64 = 8  # bytes per element: the check trains in float64


@pytest.fixture(scope="module")
def report():
    import tensor_cases  # noqa: F401  (registers tp_extra_gather; the ranks import it by name)

    return ec.check("tp_mlp", ["full_batch", TP, FSDP_TP, PLANTED])


def steps(report, spec):
    outcome = report.outcome("tp_mlp", spec)
    assert outcome.verdict is Verdict.EQUIVALENT, outcome.describe()
    return outcome.result


def test_tp_all_reduces_the_rowwise_output_over_tp_once_per_step(report):
    """The rowwise Linear's partial outputs (12 samples x 3 logits) are all-reduced over tp in its forward, once per
    step; its backward needs none (the gradient of a replicated output is replicated), nor does the colwise Linear's
    (the inputs need no gradient), nor the optimizer (each rank steps its own shards)."""
    result = steps(report, TP)
    assert result.collectives == ({"all_reduce[tp]": (1, 12 * 3 * F64)},) * 3, result.collectives
    assert result.syncs is None  # TP synchronises activations, not gradients: no sync to judge


def test_fsdp_tp_counts_fsdp2_over_dp_and_the_rowwise_all_reduce_over_tp(report):
    """On the 2 x 2 mesh each TP group sees its dp shard (6 samples): the rowwise all-reduce carries 6 x 3 logits. FSDP2
    shards each Linear (a block) over dp: per step it gathers both blocks for the forward and again for the backward
    (reshard_after_forward): 4 all-gathers of this rank's shards, rows padded to even (Linear 0's local 8x6 weight and
    8 biases: 24 + 4 elements; Linear 2's local 3x8 weight and 3 biases, padded to 4 rows: 16 + 2), twice; and it
    reduce-scatters each block's local gradient once, padded whole (56 and 36 elements)."""
    result = steps(report, FSDP_TP)
    gathered = 2 * (24 + 4 + 16 + 2) * F64
    scattered = (8 * 6 + 8 + 4 * 8 + 4) * F64
    assert result.collectives == ({"all_gather[dp]": (4, gathered), "reduce_scatter[dp]": (2, scattered),
                                   "all_reduce[tp]": (1, 6 * 3 * F64)},) * 3, result.collectives
    assert result.syncs is None and result.sync_wrappers is None


def test_a_planted_collective_shows_up_in_the_count(report):
    """tests/tensor_cases.py's regime gathers the rowwise weight (its 3 x 8 local shard) whole once per step besides:
    the same gradients, and one more all-gather over tp per step in the count."""
    planted, faithful = steps(report, PLANTED), steps(report, TP)
    for step, same in zip(planted.collectives, faithful.collectives):
        assert step == {**same, "all_gather[tp]": (1, 3 * 8 * F64)}, planted.collectives


def test_rows_show_the_counts_by_kind_and_mesh_dimension(report):
    row = next(r for r in to_rows(report) if r["regime"] == FSDP_TP)
    assert row["collectives"][0] == {"all_gather[dp]": {"calls": 4, "bytes": 2 * 46 * F64},
                                     "reduce_scatter[dp]": {"calls": 2, "bytes": 92 * F64},
                                     "all_reduce[tp]": {"calls": 1, "bytes": 18 * F64}}
    assert row["syncs"] is None
    report.assert_equivalent()


def test_a_spec_declares_what_a_step_communicates_and_any_other_count_is_a_communication_verdict():
    """``collectives=`` on a TP spec: the count it declares passes; the planted extra gather, or a declaration the step
    does not meet, is a communication verdict naming each kind, the step and the bytes."""
    import tensor_cases

    declared = "all_reduce[tp]*1"
    report = ec.check(tensor_cases.UNDECLARED, [f"{TP},collectives={declared}", f"{PLANTED},collectives={declared}",
                                               f"{TP},collectives=all_reduce[tp]*2",
                                               f"{FSDP_TP},collectives=all_reduce[tp]*1+all_gather[dp]*4"
                                               "+reduce_scatter[dp]*2", f"{TP},collectives=none"])
    met, planted, unmet, mesh, nothing = report.outcomes
    assert met.verdict is Verdict.EQUIVALENT and mesh.verdict is Verdict.EQUIVALENT, [o.describe() for o in report.outcomes]
    assert planted.verdict is Verdict.COMMUNICATION and planted.comparison.problems == (
        "communication: step 0 made all_gather[tp] 1 time (192 bytes per rank), all_reduce[tp] 1 time (288 bytes per "
        "rank); the spec declares all_reduce[tp] 1 time",)
    assert unmet.verdict is Verdict.COMMUNICATION and "the spec declares all_reduce[tp] 2 times" in \
        unmet.comparison.problems[0]
    assert nothing.verdict is Verdict.COMMUNICATION and "the spec declares none" in nothing.comparison.problems[0]


@pytest.mark.parametrize("spec", ["tp:world_size=2,collectives=all_reduce[tp]", "tp:world_size=2,collectives=x*y",
                                  "tp:world_size=2,collectives=all_reduce*1+all_reduce*2"])
def test_a_declaration_that_does_not_read_is_refused_naming_it(spec):
    with pytest.raises(ec.InvalidArgument, match=r"collectives=.* is not allowed: expected kinds times their calls "
                                                 r"per step, each kind once, joined by '\+'"):
        ec.parse_regime(spec)
