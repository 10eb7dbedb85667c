"""DistributedDataParallel's options as spec fields: none may change the gradients, and under each a real
bug is still caught."""

import parallel_bugs  # noqa: F401  (registers the bugs; the ranks import it by name)
import pytest

import equivcheck as ec
from equivcheck import Verdict

OPTIONS = ["gradient_as_bucket_view=1", "bucket_cap_mb=0.0001", "static_graph=1", "broadcast_buffers=0"]


@pytest.fixture(scope="module")
def report():
    specs = [f"{name}:world_size=2,{option}" for option in OPTIONS for name in ("ddp", "ddp_forgets_the_world_size")]
    return ec.check("block_stack", [*specs, "ddp_no_sync:world_size=2,chunks=3,gradient_as_bucket_view=1"])


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_matches_full_batch_and_its_twin_bug_is_caught(report, option):
    faithful = report.outcome("block_stack", f"ddp:world_size=2,{option}")
    assert faithful.verdict is Verdict.EQUIVALENT and faithful.comparison.margin < 1e-2
    assert faithful.result.syncs == (1, 1, 1)  # many buckets or one: one synchronised backward per step
    bug = report.outcome("block_stack", f"ddp_forgets_the_world_size:world_size=2,{option}")
    assert bug.verdict is Verdict.MISMATCH and bug.comparison.margin > 100


def test_options_reach_accumulation_too(report):
    outcome = report.outcome("block_stack", "ddp_no_sync:world_size=2,chunks=3,gradient_as_bucket_view=1")
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.result.syncs == (1, 1, 1)


def test_find_unused_parameters_trains_an_unused_branch():
    report = ec.check("unused_branch")
    assert [o.verdict for o in report.outcomes[1:]] == [Verdict.EQUIVALENT, Verdict.EQUIVALENT]


def test_options_print_back_and_unknown_ones_name_the_allowed():
    regime = ec.parse_regime("ddp:world_size=2,bucket_cap_mb=0.5,static_graph=true")
    assert str(regime) == "ddp:world_size=2,bucket_cap_mb=0.5,static_graph=1"
    assert regime.ddp_options() == {"bucket_cap_mb": 0.5, "static_graph": True}
    with pytest.raises(ec.InvalidArgument, match="ddp takes world_size=..., backend=..., gradient_as_bucket_view=..., "
                                                 "bucket_cap_mb=..., static_graph=..., broadcast_buffers=..., "
                                                 "find_unused_parameters=..."):
        ec.parse_regime("ddp:world_size=2,bucket_cap=5")
    with pytest.raises(ec.InvalidArgument, match="bucket_cap_mb"):
        ec.parse_regime("ddp:world_size=2,bucket_cap_mb=0")
