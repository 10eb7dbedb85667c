"""Peak activation memory: exact run to run, the savings each regime promises, and the gate on them.

Every expectation has its twin: the regime that keeps every graph alive (seed 002's
``loss += item_loss``, registered as ``summed_loss``) is exact and must be reported as saving nothing.
"""

import dataclasses
import functools
import json
import sys

import pytest
import torch

import equivcheck as ec
from equivcheck.process import seeding
from equivcheck.cli import main
from equivcheck.measure.activation import SAVED_TENSORS, SavedTensorMeter
from equivcheck.runners.train import build_model, load_batches
from equivcheck.judge.memory import SAVES_NOTHING

BATCH_12 = ["mlp", "cnn", "tokens", "gru_decoder", "seed000_embedding_head", "batchnorm_cnn"]
SPLIT = ["mlp", "cnn", "tokens", "gru_decoder", "seed000_embedding_head"]


@functools.lru_cache(maxsize=None)
def peak(case, spec):
    """Each (case, regime) runs once for the whole module: the figure is exact, so reuse is safe."""
    result = ec.run(case, spec)
    assert result.memory_method == SAVED_TENSORS
    return result.peak_activation_bytes


def ratio(case, spec):
    return peak(case, spec) / peak(case, "full_batch")


def graph_of(case_name, forward):
    """What the meter sees for ``forward(case, model, batch)`` on a case's first global batch: (peak, output bytes)."""
    case = ec.get_case(case_name)
    with seeding.seeded(), seeding.default_dtype(case.dtype):
        model = build_model(case)
        batch = load_batches(case)[0]
        with SavedTensorMeter([*model.parameters(), batch.inputs, batch.targets]) as meter:
            output = forward(case, model, batch)
    return meter.peak, output.untyped_storage().nbytes()


@pytest.fixture(scope="module")
def report():
    return ec.check_all(BATCH_12, ["accumulate:chunks=4", "summed_loss:chunks=4", "retained_graph:chunks=4"])


@pytest.mark.parametrize("spec", ["full_batch", "retained_graph:chunks=3", "summed_loss:chunks=4"])
def test_the_figure_is_exact_run_to_run(spec):
    first, second = (ec.run("gru_decoder", spec).peak_activation_bytes for _ in range(2))
    assert first == second == peak("gru_decoder", spec) > 0


@pytest.mark.parametrize("case", BATCH_12)
@pytest.mark.parametrize("chunks", [2, 4, 12])
def test_accumulate_with_k_chunks_peaks_near_one_kth(case, chunks):
    # Each micro-batch's graph is freed by its backward: only one is alive at a time.
    assert abs(ratio(case, f"accumulate:chunks={chunks}") * chunks - 1) <= 0.1


@pytest.mark.parametrize("case", [*BATCH_12, "seed004_linear"])
def test_sample_by_sample_peaks_near_one_over_batch(case):
    batch_size = ec.get_case(case).batch_size
    assert abs(ratio(case, "sample_by_sample") * batch_size - 1) <= 0.1


@pytest.mark.parametrize("case", SPLIT)
def test_detached_partial_cuts_the_heads_share_by_k_and_leaves_the_trunks(case):
    """With K chunks the peak is trunk + head / K exactly; the trunk's share is the trunk's own graph."""
    by_chunks = {k: peak(case, f"detached_partial:chunks={k}") for k in (1, 2, 4, 12)}
    assert by_chunks[1] == peak(case, "full_batch")
    head = 2 * (by_chunks[1] - by_chunks[2])
    trunk = by_chunks[1] - head
    for k, measured in by_chunks.items():
        assert measured == pytest.approx(trunk + head / k, rel=1e-3)
    # The trunk's graph, and its output: the head's input, which lives whole while the head runs per chunk.
    # 1% of slack covers what each chunk saves whatever its size (the loss's scalars).
    trunk_graph, trunk_output = graph_of(case, lambda c, model, batch: c.split(model)[0](batch.inputs))
    assert trunk_graph <= trunk <= trunk_graph + trunk_output + 0.01 * by_chunks[1]


@pytest.mark.parametrize("case", BATCH_12)
def test_summed_loss_accumulates_but_saves_nothing_and_the_harness_says_so(case, report):
    accumulated, summed = (report.outcome(case, spec) for spec in ("accumulate:chunks=4", "summed_loss:chunks=4"))
    # The gradients are exact (BatchNorm aside: it sees each micro-batch's statistics): only the memory is wasted.
    assert summed.verdict is (ec.Verdict.MISMATCH if case == "batchnorm_cnn" else ec.Verdict.EQUIVALENT)
    assert summed.memory.ratio >= 1 and summed.memory.note == SAVES_NOTHING
    assert accumulated.memory.ratio < 0.3 and accumulated.memory.note == ""


@pytest.mark.parametrize("case", BATCH_12)
def test_retained_graph_keeps_the_whole_models_graph(case):
    """It chunks only the loss: the model's graph of the whole batch stays alive to the last backward."""
    model_graph, _ = graph_of(case, lambda c, model, batch: model(batch.inputs))
    retained = peak(case, "retained_graph:chunks=4")
    assert retained >= model_graph
    assert retained > 2 * peak(case, "accumulate:chunks=4")


def test_every_saved_storage_is_released_when_the_graph_goes():
    """No record outlives its graph (a leak would inflate every later peak)."""
    case = ec.get_case("gru_decoder")
    for spec in ("full_batch", "retained_graph:chunks=3", "summed_loss:chunks=3", "detached_partial:chunks=3"):
        regime = ec.parse_regime(spec)
        with seeding.seeded(), seeding.default_dtype(case.dtype):
            model = build_model(case)
            batch = load_batches(case)[0]
            optimizer = case.optimizer(model.parameters())
            with SavedTensorMeter([*model.parameters()]) as meter:
                regime.train_step(model, optimizer, batch, ec.Objective(case))
        assert meter.peak > 0 and meter.live == 0, spec


def test_a_storage_saved_twice_counts_once_and_parameters_not_at_all():
    weight = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float64))
    x = torch.ones(3, 4, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter([weight]) as meter:
        hidden = (x @ weight).tanh()  # mm saves x and weight; tanh saves its output
        out = hidden * hidden  # saves the same storage twice
    assert meter.peak == x.nbytes + hidden.nbytes
    del out
    assert meter.live == meter.peak  # the product's two records went, but tanh still saves that storage
    del hidden
    assert meter.live == 0


def test_a_record_stopped_half_built_by_a_signal_goes_quietly(monkeypatch):
    """The CLI's SIGTERM can land inside a record's ``__init__``; its finalizer must not print a traceback."""
    from equivcheck.measure.activation import _Saved

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    half_built = _Saved.__new__(_Saved)  # what is left when __init__ raised before its first line
    del half_built
    assert dropped == []


def test_assert_saves_memory_gates_on_the_ratio(report):
    report.assert_saves_memory("accumulate:chunks=4", max_ratio=0.35)
    report.assert_saves_memory("accumulate:chunks=4", max_ratio=0.35, case="tokens")
    with pytest.raises(ec.MemoryNotSaved) as raised:
        report.assert_saves_memory("summed_loss:chunks=4", max_ratio=0.35)
    message = str(raised.value)
    assert "6 of 6 runs of summed_loss:chunks=4 peak above 0.35x" in message
    assert f"mlp under summed_loss:chunks=4: peak activation memory 1.2 KiB = 1.019x the reference's 1.2 KiB " \
           f"(saved_tensors); {SAVES_NOTHING}" in message
    assert isinstance(raised.value, AssertionError)
    with pytest.raises(ec.MemoryNotSaved, match="retained_graph:chunks=4 peak above 0.35x"):
        report.assert_saves_memory("retained_graph:chunks=4", max_ratio=0.35)


@dataclasses.dataclass(frozen=True)
class TeamStep(ec.Regime):
    """A team's own training step: accumulates over halves, but keeps both graphs for one backward."""

    name = "team_step"
    summary = "a candidate step under test"

    def train_step(self, model, optimizer, batch, objective):
        first, second = zip(batch.inputs.tensor_split(2), batch.targets.tensor_split(2))
        loss = (objective.sum(model(first[0]), first[1]) + objective.sum(model(second[0]), second[1])) / batch.items
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def per_quarter_step(model, optimizer, batch):
    """A team's step accumulating four quarters of the batch: it saves memory."""
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(4), targets.tensor_split(4)):
        (torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_check_step_report_is_gated_by_the_label_it_prints():
    report = ec.check_step("mlp", per_quarter_step)
    report.assert_saves_memory("step:per_quarter_step", max_ratio=0.35)
    with pytest.raises(ec.MemoryNotSaved, match="mlp under step:per_quarter_step: peak activation memory"):
        report.assert_saves_memory("step:per_quarter_step", max_ratio=0.2)


def test_a_candidate_step_is_gated_the_same_way():
    report = ec.check("mlp", [TeamStep()])
    assert report.outcomes[0].verdict is ec.Verdict.EQUIVALENT
    with pytest.raises(ec.MemoryNotSaved, match="mlp under team_step: peak activation memory"):
        report.assert_saves_memory(TeamStep(), max_ratio=0.6)


@pytest.mark.parametrize(("max_ratio", "message"), [(0, "max_ratio=0 is not allowed"),
                                                    ("0.3", "Expected a number > 0 but got max_ratio='0.3'"),
                                                    (True, "Expected a number > 0 but got max_ratio=True")])
def test_assert_saves_memory_bad_input(max_ratio, message, report):
    with pytest.raises(ec.InvalidArgument, match=message):
        report.assert_saves_memory("accumulate:chunks=4", max_ratio=max_ratio)
    with pytest.raises(ec.InvalidArgument, match="unknown outcome 'any case under accumulate:chunks=2'; known"):
        report.assert_saves_memory("accumulate:chunks=2", max_ratio=0.5)


def test_measurement_can_be_switched_off():
    result = ec.run("mlp", "full_batch", measure_memory=False)
    assert result.peak_activation_bytes is None and result.memory_method is None


def test_matrix_and_json_show_peak_and_ratio(tmp_path, capsys):
    path = tmp_path / "out.json"
    code = main(["run", "--case", "mlp", "--regime", "full_batch", "--regime", "accumulate:chunks=4",
                 "--regime", "summed_loss:chunks=4", "--json", str(path), "--matrix"])
    out = capsys.readouterr().out
    assert code == 0
    memory_rows = [line.split() for line in out.splitlines() if line.startswith("mlp ")]  # overview, verdicts, memory
    assert memory_rows[2] == ["mlp", "1.2", "KiB", "1.00x", "320", "B", "0.25x", "1.2", "KiB", "1.02x!"]
    assert f"mlp under summed_loss:chunks=4 {SAVES_NOTHING} (peak 1.019x the reference's)" in out
    rows = json.loads(path.read_text())["rows"]
    assert [(r["peak_activation_bytes"], r["memory_ratio"], r["memory_note"]) for r in rows] == [
        (1256, 1.0, ""), (320, 320 / 1256, ""), (1280, 1280 / 1256, SAVES_NOTHING)]
    assert {r["memory_method"] for r in rows} == {SAVED_TENSORS}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the allocator meter needs one")
def test_on_cuda_the_allocator_peak_is_used():
    """A case trains on CUDA in a CUDA precision mode (the harness places model and data itself)."""
    full, accumulated = (ec.run("mlp", spec, dtype="fp16-autocast") for spec in ("full_batch", "accumulate:chunks=4"))
    assert full.memory_method == accumulated.memory_method == "cuda_allocator"
    assert 0 < accumulated.peak_activation_bytes <= full.peak_activation_bytes
