"""A timeout measures silence: what counts as progress, and how the deadline follows it."""

from __future__ import annotations

import torch

from equivcheck.process import progress


def test_a_graph_torch_compile_compiles_is_progress(tmp_path, monkeypatch):
    """A first step's compiling takes minutes on a loaded machine with no optimizer step: each graph's start and end
    move the deadline (the regimes' compile=, and a team's own torch.compile inside its step alike)."""
    monkeypatch.setattr(progress, "_file", None)  # this process reports nowhere once the test is over
    with open(tmp_path / "progress", "w+b") as stamp:
        progress.report_to(stamp.fileno())
        before = progress.last(stamp.fileno())
        torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(3))
        assert progress.last(stamp.fileno()) > before


def test_the_deadline_follows_the_least_recent_progress_of_those_still_owing_an_answer():
    assert progress.deadline(100.0, 5.0, [None, None]) == 105.0  # nothing said yet: the job's own start
    assert progress.deadline(100.0, 5.0, [90.0]) == 105.0  # progress from before the job does not count
    assert progress.deadline(100.0, 5.0, [120.0, 130.0]) == 125.0  # the laggard decides: it may wait on a hung peer
