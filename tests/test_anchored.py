"""Each step judged from the reference's state (runners/anchors.py): a large lower-precision check (forced here by
ANCHOR_STEPS_FROM = 0) is equivalent where only compounding rounding parts its runs, with no float64 shadow trained,
and still catches a fault at the step where it acts. Each guard of the anchored judgement, planted out, lets a fault
pass as equivalent: the test says so."""

import collections
import dataclasses
import sys

import pytest
import torch

import equivcheck as ec
import equivcheck.device as devices
from equivcheck import Verdict
from equivcheck.diff import TensorDiff
from equivcheck.precision import SHADOW, Tolerance
from equivcheck.regimes.local import Accumulate
from equivcheck.runners import anchors, train
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from test_rounding import ILL, SEED, counting_shadows

CHECK = sys.modules["equivcheck.check"]  # the package's ``check`` is the function


@pytest.fixture(params=["whole", "in blocks"])
def anchored(request, monkeypatch):
    """Anchoring forced; "in blocks": every parameter of more than two elements and one row read back, restored and
    updated a row at a time, as a large model's are (anchors.BLOCK_BYTES)."""
    monkeypatch.setattr(CHECK, "ANCHOR_STEPS_FROM", 0)
    if request.param == "in blocks":
        monkeypatch.setattr(anchors, "BLOCK_BYTES", 8)


def _after_first_step(optimizer) -> bool:
    """True once, after the optimizer's first step: a fault that acts there and nowhere else."""
    state = optimizer.__dict__.setdefault("_anchored_test_steps", [0])
    state[0] += 1
    return state[0] == 1


# Faults of a team's own between steps, each acting after the first step alone.
FAULTS = {
    "decays": lambda model, optimizer: [p.mul_(0.9) for p in model.parameters()],  # a weight decay of its own
    "forgets_moments": lambda model, optimizer: optimizer.state.clear(),  # a resumed optimizer that lost its state
    "halves_rate": lambda model, optimizer: [group.update(lr=group["lr"] / 2) for group in optimizer.param_groups],
    "resets_statistics": lambda model, optimizer: [m.reset_running_stats() for m in model.modules()
                                                   if isinstance(m, torch.nn.BatchNorm2d)],  # running stats lost
    "nudges_weights": lambda model, optimizer: [p.add_(1e-3) for p in model.parameters()],  # a start of its own
}


@dataclasses.dataclass(frozen=True)
class FaultAfterTheFirstStep(Accumulate):
    """Accumulation, then one of :data:`FAULTS` after the first optimizer step and never again (``at_start``:
    before the first forward instead)."""

    name = "fault_after_first_step"
    fault: str = "decays"
    at_start: bool = False

    def train_step(self, model, optimizer, batch, objective):
        if self.at_start and not getattr(optimizer, "_anchored_test_started", False):
            optimizer._anchored_test_started = True
            with torch.no_grad():
                FAULTS[self.fault](model, optimizer)
        loss = super().train_step(model, optimizer, batch, objective)
        if not self.at_start and _after_first_step(optimizer):
            with torch.no_grad():
                FAULTS[self.fault](model, optimizer)
        return loss


@dataclasses.dataclass(frozen=True)
class ZeroesAGradientInTheStep(Accumulate):
    """Accumulation whose optimizer zeroes the first parameter's gradient once its step has begun (a step hook of the
    team's own, registered as it trains): its updates are of other gradients than those the recorder compared."""

    name = "zeroes_a_gradient_in_the_step"

    def train_step(self, model, optimizer, batch, objective):
        if not getattr(optimizer, "_anchored_test_hooked", False):
            optimizer._anchored_test_hooked = True
            first = next(model.parameters())

            def zeroes(*args) -> None:
                first.grad.zero_()

            optimizer.register_step_pre_hook(zeroes)
        return super().train_step(model, optimizer, batch, objective)


@dataclasses.dataclass(frozen=True)
class HalvesLastRowsInTheStep(Accumulate):
    """Accumulation whose optimizer halves the last row of every matrix as it steps (a step hook its making added): a
    fault of the update alone, in the rows read last."""

    name = "halves_last_rows_in_the_step"

    def build_optimizer(self, case, model):
        optimizer = super().build_optimizer(case, model)

        def halves(*args) -> None:
            with torch.no_grad():
                for parameter in model.parameters():
                    if parameter.dim() == 2:
                        parameter[-1].mul_(0.5)

        optimizer.register_step_post_hook(halves)
        return optimizer


@dataclasses.dataclass(frozen=True)
class ForwardUnhooked(Accumulate):
    """Accumulation whose model is run through ``forward`` itself: no module hook sees its steps begin."""

    name = "forward_unhooked"

    def train_step(self, model, optimizer, batch, objective):
        class Direct(torch.nn.Module):
            def forward(self, inputs):
                return model.forward(inputs)
        return super().train_step(Direct(), optimizer, batch, objective)


def test_rounding_that_compounds_passes_anchored_with_no_shadow(anchored, monkeypatch):
    """The ill-conditioned case, whose float32 runs part free-running (test_rounding): anchored, each step's
    gradients and update match the reference's from the same state; three runs, all float32."""
    calls = counting_shadows(monkeypatch)
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.ok, outcome.describe()
    assert outcome.comparison.note == CHECK.ANCHORED and "judged step by step" in outcome.describe()
    assert SHADOW not in calls and calls == ["float32"] * 3  # the reference, its repeat, the candidate


@pytest.mark.parametrize("regime", ["zero_grad_inside:chunks=5", "naive_accumulate:chunks=5",
                                    "clip_per_micro_batch:chunks=5,max_norm=0.01", "step_per_micro_batch:chunks=5"])
def test_the_pitfalls_are_caught_anchored(anchored, regime):
    (outcome,) = ec.check(ILL, [regime], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH, outcome.describe()
    assert outcome.comparison.note != CHECK.ANCHORED  # a mismatch is judged free-running, with its hints


@pytest.mark.parametrize(("case", "regime", "guard"), [
    # a weight written after the step took it
    (ILL, FaultAfterTheFirstStep(chunks=3, fault="decays"), "_written_since_the_step"),
    # the optimizer's state replaced after the step
    (ILL, FaultAfterTheFirstStep(chunks=3, fault="forgets_moments"), "_written_since_the_step"),
    # the settings it carries into the next step
    (ILL, FaultAfterTheFirstStep(chunks=3, fault="halves_rate"), "_compare_settings"),
    # the running statistics it carries (one micro-batch: BatchNorm sees the whole batch, as the reference does)
    ("batchnorm_cnn", FaultAfterTheFirstStep(chunks=1, fault="resets_statistics"), "_compare_buffers"),
    # weights of its own before the first step begins
    (ILL, FaultAfterTheFirstStep(chunks=3, fault="nudges_weights", at_start=True), "_began_elsewhere"),
    # a gradient written inside the step, after the recorder compared it
    (ILL, ZeroesAGradientInTheStep(chunks=3), "_gradient_versions"),
], ids=["decays", "forgets_moments", "halves_rate", "resets_statistics", "nudges_weights", "gradient_in_the_step"])
def test_a_fault_between_steps_is_caught_anchored_and_passes_with_its_guard_planted_out(anchored, monkeypatch, case,
                                                                                         regime, guard):
    (outcome,) = ec.check(case, [regime], seed=SEED, dtype="float32").outcomes
    assert outcome.verdict is Verdict.MISMATCH, outcome.describe()
    monkeypatch.setattr(anchors.Anchoring, guard, lambda self, *args: None)
    (planted,) = ec.check(case, [regime], seed=SEED, dtype="float32").outcomes
    assert planted.verdict is Verdict.EQUIVALENT and planted.comparison.note == CHECK.ANCHORED  # the fault passes


def test_a_fault_of_the_update_alone_is_caught_in_the_last_block(anchored):
    """Every block of an update is compared, the last rows' too (in blocks, the first layer's weight is read a row at
    a time)."""
    assert len(anchors._rows(ILL.model()[0].weight)) == (2 if anchors.BLOCK_BYTES == 8 else 1)
    (outcome,) = ec.check(ILL, [HalvesLastRowsInTheStep(chunks=3)], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH, outcome.describe()


def test_a_run_whose_steps_no_hook_saw_begin_is_judged_free_running(anchored, monkeypatch):
    """No anchor was loaded: the verdict must not claim the anchored judgement (with the guard planted out, it does)."""
    (outcome,) = ec.check("mlp", [ForwardUnhooked(chunks=3)], dtype="float32").outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note != CHECK.ANCHORED
    monkeypatch.setattr(anchors.Anchoring, "__exit__", lambda self, *exc: self._starts.__exit__(*exc))  # says nothing
    (planted,) = ec.check("mlp", [ForwardUnhooked(chunks=3)], dtype="float32").outcomes
    assert planted.comparison.note == CHECK.ANCHORED


ANCHORABLE = sorted(name for name, cls in ec.REGIMES.items() if cls.anchorable and not cls.pitfall)
FITTING_CASE = {"packed": "packed_documents"}  # a regime that fits some cases alone, and the built-in case it fits


@pytest.mark.parametrize("name", ANCHORABLE)
def test_every_anchorable_faithful_regime_is_judged_anchored(anchored, name):
    """A regime that declares itself anchorable begins each step through the whole model's forward: a large check
    of it is decided anchored, never by an anchored run thrown away (drawn checks of a regime that ran its parts
    apart all fell back, one training wasted each)."""
    fields = {field.name for field in dataclasses.fields(ec.REGIMES[name])}
    spec = f"{name}:chunks=3" if "chunks" in fields else name
    (outcome,) = ec.check(FITTING_CASE.get(name, "mlp"), [spec], dtype="float32", reference="full_batch").outcomes
    if spec != "full_batch":
        assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note == CHECK.ANCHORED, outcome.describe()


def test_a_small_or_float64_check_stays_free_running(monkeypatch):
    calls = counting_shadows(monkeypatch)
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes  # 64 MiB of recording and more only
    assert outcome.comparison.note != CHECK.ANCHORED and SHADOW in calls
    monkeypatch.setattr(CHECK, "ANCHOR_STEPS_FROM", 0)
    (outcome,) = ec.check("mlp", ["accumulate:chunks=3"]).outcomes  # float64: exact enough free-running
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note != CHECK.ANCHORED


def _tensor_pair(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    expected = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    actual = expected * (1 + 1e-7)  # every element within float32's tolerance, none equal
    if kind == "one element off":
        actual[6, 3] += 1.0  # in the last slice
    if kind == "nan":
        actual[2, 1] = float("nan")
    if kind == "complex":
        expected, actual = torch.complex(expected, expected.flip(0)), torch.complex(actual, expected.flip(0))
        actual[5, 0] += 1j
    return actual, expected


@pytest.mark.parametrize("kind", ["equal", "within", "one element off", "nan", "complex"])
def test_a_tensor_judged_a_slice_at_a_time_has_the_figures_of_it_judged_whole(kind):
    """What an anchored update is judged by, a block of rows at a time (TensorDiff.joined): the same margin, counts,
    greatest differences and where they are as the whole tensor's."""
    actual, expected = _tensor_pair(kind)
    if kind == "equal":
        actual = expected.clone()
    tolerance = Tolerance.resolve(torch.float32)
    whole = TensorDiff.of(actual, expected, tolerance)
    parts = [(start * 5, TensorDiff.of(actual[start:start + 2].reshape(-1), expected[start:start + 2].reshape(-1),
                                       tolerance)) for start in range(0, 7, 2)]
    assert repr(TensorDiff.joined(parts, expected.shape)) == repr(whole)  # a NaN figure equals nothing, its repr does
    assert (whole.margin > 1) == (kind not in ("equal", "within"))


class Transfers(TorchDispatchMode):
    """The bytes every op made on one device from a tensor on another, by (from, to): ``copy_`` and ``.to()`` alike."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sources = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for made in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            for source in sources - {made.device}:
                self.moved[(source.type, made.device.type)] += made.numel() * made.element_size()
        return out


def test_an_anchored_check_on_a_device_moves_nothing_off_it(monkeypatch):
    """On a GPU with room, the reference's recording and its step starts stay in the device's memory, and every
    comparison is made there (anchors.held_on). Here the CPU plays the device: the host the recording would go to
    is "meta", and every byte made there is counted, through the check's own code path. Held, none is, and no file is
    written; with the recording's copies sent to the host whatever their home (the planted fault), its gradients
    cross."""
    monkeypatch.setattr(CHECK, "ANCHOR_STEPS_FROM", 0)
    monkeypatch.setattr(devices, "HOST", torch.device("meta"))
    files = []
    monkeypatch.setattr(anchors._Files, "save", lambda self, *args: files.append(args))
    monkeypatch.setattr(anchors, "held_on", lambda *args: True)
    with Transfers() as transfers:
        (outcome,) = ec.check(ILL, ["accumulate:chunks=3"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note == CHECK.ANCHORED, outcome.describe()
    assert transfers.moved[("cpu", "meta")] == 0 and not files and not anchors._HELD  # released with the check
    kept = train.snapshot
    monkeypatch.setattr(train, "snapshot", lambda named, *args, home=None, **kwargs: kept(named, *args, **kwargs))
    with Transfers() as planted:
        ec.check(ILL, ["accumulate:chunks=3"], seed=SEED)
    gradients = sum(p.numel() * 4 for p in ILL.model().parameters())
    assert planted.moved[("cpu", "meta")] >= gradients  # a step's gradients at least (the run breaks on "meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False")
def test_an_anchored_check_on_a_gpu_copies_no_gradient_to_the_host(monkeypatch):
    """The same on a GPU itself: of every step's gradients, weights and moments, nothing comes to the host."""
    monkeypatch.setattr(CHECK, "ANCHOR_STEPS_FROM", 0)
    with Transfers() as transfers:
        (outcome,) = ec.check(ILL, ["accumulate:chunks=3"], seed=SEED, device="cuda").outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note == CHECK.ANCHORED, outcome.describe()
    smallest = min(p.numel() * 4 for p in ILL.model().parameters())
    assert transfers.moved[("cuda", "cpu")] < smallest, transfers.moved


def test_ranks_beside_an_anchored_regime_are_handed_the_reference_it_keeps_in_files(anchored, monkeypatch):
    """Ranks compare with the reference as they train (forced here): they map it from a file of plain tensors, whether
    the reference keeps its recording in memory or in files (anchors.OnDisk)."""
    monkeypatch.setattr(CHECK, "COMPARE_AS_IT_TRAINS_FROM", 0)
    anchored_run, on_ranks = ec.check(ILL, ["accumulate:chunks=3", "ddp:world_size=2"], seed=SEED).outcomes
    assert anchored_run.verdict is Verdict.EQUIVALENT and anchored_run.comparison.note == CHECK.ANCHORED
    assert on_ranks.verdict is Verdict.EQUIVALENT, on_ranks.describe()


def test_the_reference_update_of_a_team_optimizer_runs_none_of_the_runs_step_hooks():
    """An optimizer whose constructor takes no param groups is copied for the reference's update: the copy steps the
    one parameter it is given, from no state, and none of the run's step hooks (the recorder's) see it."""
    from equivcheck_cases.muon import MuonWithAdamW

    matrix, bias = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    team = MuonWithAdamW([matrix], [bias])
    seen = []
    team.register_step_pre_hook(lambda *_: seen.append("pre"))
    team.register_step_post_hook(lambda *_: seen.append("post"))
    weight = torch.nn.Parameter(bias.detach().clone())
    weight.grad = torch.ones(3)
    alike = anchors._alike(team, {**team.param_groups[1], "params": [weight]})
    alike.step()
    assert seen == [] and set(alike.state) == {weight} and not team.state
    assert type(alike) is MuonWithAdamW and not torch.equal(weight, bias)


class ShiftedLogits(torch.nn.Module):
    """A linear classifier with one shift added to every logit: softmax ignores it, so its gradient is rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.shift = torch.nn.Linear(6, 3), torch.nn.Parameter(torch.zeros(()))

    def forward(self, inputs):
        return self.linear(inputs) + self.shift


# Adam with no epsilon to speak of steps the shift by its learning rate, the sign of its rounding-level gradient.
SHIFTED = ec.Case(name="shifted_logits_adam", model=ShiftedLogits, data=ILL.data, loss=ILL.loss, batch_size=12,
                  steps=3, optimizer=lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-30),
                  dtype=torch.float32)


def test_a_step_that_follows_the_references_own_is_not_computed_again(anchored, monkeypatch):
    """A parameter whose new weight and state are within tolerance of what the reference's own step left is judged
    by that: the reference's optimizer steps no parameter again (a matrix optimizer's Newton-Schulz would cost a
    training's step). Where the run's update parts from it, the reference's update of the run's gradient decides:
    a rounding-level gradient Adam turns into an update of its own (the shift's) passes, judged so, and a fault of
    the update alone is caught."""
    recomputed = collections.Counter()
    original = anchors.Anchoring._recomputed

    def counting(self, step, index, name, *args):
        recomputed[name] += 1
        return original(self, step, index, name, *args)

    monkeypatch.setattr(anchors.Anchoring, "_recomputed", counting)
    (outcome,) = ec.check(ILL, ["accumulate:chunks=5"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note == CHECK.ANCHORED, outcome.describe()
    assert not recomputed
    (outcome,) = ec.check(SHIFTED, ["accumulate:chunks=3"], seed=SEED).outcomes
    assert outcome.verdict is Verdict.EQUIVALENT and outcome.comparison.note == CHECK.ANCHORED, outcome.describe()
    assert set(recomputed) == {"shift"}, recomputed
    recomputed.clear()
    (outcome,) = ec.check(ILL, [HalvesLastRowsInTheStep(chunks=3)], seed=SEED).outcomes
    assert outcome.verdict is Verdict.MISMATCH and recomputed, outcome.describe()
