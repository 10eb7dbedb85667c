"""Models as they come: outputs that are not tensors, optimizers built from the model, losses in float32,
and hints that match what the step did. Each written as a user meets it, with its twin."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec

MLP = ec.get_case("mlp")


class LogitsAndLoss(nn.Module):
    """A model whose forward returns (logits, None) without targets, as nanoGPT's GPT does."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))

    def forward(self, x):
        return self.body(x), None

    def configure_optimizers(self, weight_decay, learning_rate):
        """nanoGPT's grouping: weight decay on matrices only."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate)


TUPLE_MODEL = dataclasses.replace(MLP, name="tuple_model", model=LogitsAndLoss, split=None,
                                  loss=lambda output, targets: F.cross_entropy(output.reshape(-1, 3), targets,
                                                                               reduction="none"))


def test_a_model_whose_output_is_not_a_tensor_is_named_with_the_way_out():
    with pytest.raises(ec.InvalidArgument, match=r"the model of case 'tuple_model' returned a tuple of "
                                                 r"\(Tensor \(12, 3\), NoneType\), and its loss raised AttributeError"):
        ec.check(TUPLE_MODEL, ["accumulate:chunks=4"])


def logits_loss(output, targets):
    return F.cross_entropy(output[0], targets, reduction="none")


def test_its_twin_reads_the_logits_in_the_loss_and_uses_the_models_own_optimizer_grouping():
    case = dataclasses.replace(TUPLE_MODEL, name="tuple_model_fixed", loss=logits_loss,
                               optimizer=lambda params: params.model.configure_optimizers(0.1, 1e-2))
    report = ec.check(case, ["accumulate:chunks=4", "naive_accumulate:chunks=5"])
    assert report.outcome("tuple_model_fixed", "accumulate:chunks=4").verdict is ec.Verdict.EQUIVALENT
    assert report.outcome("tuple_model_fixed", "naive_accumulate:chunks=5").verdict is ec.Verdict.MISMATCH
    optimizer = case.optimizer(ec.case.ModelParameters(LogitsAndLoss()))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


class UpcastingLoss:
    """A loss that computes in float32 whatever the model's dtype, as Hugging Face causal-LM losses do."""

    def __call__(self, output, targets):
        return F.cross_entropy(output.float(), targets, reduction="none")


def test_a_float64_case_whose_loss_runs_in_float32_is_warned_about_and_its_twin_is_not():
    upcast = dataclasses.replace(MLP, name="mlp_float32_loss", loss=UpcastingLoss())
    with pytest.warns(ec.PrecisionWarning, match="trains in float64 but its loss is computed in torch.float32") as seen:
        ec.check(upcast, ["accumulate:chunks=4"])
    assert seen[0].filename == __file__  # the warning points at the user's own call
    with warnings.catch_warnings():
        warnings.simplefilter("error", ec.PrecisionWarning)
        ec.check(MLP, ["accumulate:chunks=4"])


# A float64 case with a float32 loss: its runs part by float32's rounding of the loss, which a float64 tolerance
# cannot tell from a bug (whether one ulp of a float32 loss of about 4 exceeds float64's rtol=1e-7 depends on the CPU's
# kernels: one machine here measured 2 ulps and margin 1.9, another 1 ulp and margin 0.98; at rtol=atol=1e-9 any is).
WIDE_UPCAST = ec.Case(name="wide_float32_loss", model=lambda: torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 50)),
    data=lambda: (torch.randn(48, 16), torch.randint(0, 50, (48,))), loss=UpcastingLoss(), batch_size=16, steps=3,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


@pytest.mark.filterwarnings("ignore::equivcheck.PrecisionWarning")
def test_a_loss_computed_below_the_cases_dtype_is_judged_at_its_own_precisions_tolerance():
    reference, regime = ec.run(WIDE_UPCAST, "full_batch", seed=4), ec.run(WIDE_UPCAST, "accumulate:chunks=3", seed=4)
    apart = ec.compare(reference, regime, rtol=1e-9, atol=1e-9)
    assert apart.margin > 1 and apart.max_rel > 1e-8  # apart by float32's rounding, 1e8 times float64's own
    (outcome,) = ec.check(WIDE_UPCAST, ["accumulate:chunks=3"], seed=4).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT
    assert outcome.comparison.tolerance == ec.Tolerance.resolve(torch.float32)
    assert ("the loss is computed in torch.float32 under a float64 case: judged at float32's tolerance "
            "(rtol=1.3e-06, atol=1e-05)") in outcome.reason
    # the twin: a real pitfall on the same case is caught at that tolerance by orders of magnitude
    (naive,) = ec.check(WIDE_UPCAST, ["naive_accumulate:chunks=5"], seed=4).outcomes
    assert naive.verdict is ec.Verdict.MISMATCH and naive.comparison.margin > 100
    # a tolerance the call gives is kept: the user's word, not the loss's dtype
    (given,) = ec.check(WIDE_UPCAST, ["accumulate:chunks=3"], seed=4, rtol=1e-9, atol=1e-9).outcomes
    assert given.verdict is ec.Verdict.MISMATCH and "the loss is computed" not in given.reason


# --- hints that match the evidence --------------------------------------------------------------------

def step(model, optimizer, batch, *, micro_batches=4, divide=True, clip=None, mean_of_means=False):
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
        if mean_of_means:
            loss = F.cross_entropy(model(x), y) / micro_batches
        else:
            loss = F.cross_entropy(model(x), y, reduction="sum") / (len(targets) if divide else 1)
        loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()


def test_clipping_that_only_the_step_does_is_named_beside_loss_scaling():
    (outcome,) = ec.check_step("mlp", lambda m, o, b: step(m, o, b, clip=0.3)).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert "gradient clipping that engages in only one of the two" in outcome.comparison.hint


def test_a_divergence_from_a_later_step_names_clipping_beside_carried_state():
    """A missing / K under clipping that engages at step 0 gives the same clipped gradient there and
    shows only once the norm falls below max_norm: the hint lists it with the carried state."""
    reference = ec.run("mlp", "full_batch")
    later = tuple(grads if step == 0 else {n: g * 1.5 for n, g in grads.items()}
                  for step, grads in enumerate(reference.grads))
    candidate = dataclasses.replace(reference, grads=later)
    hint = ec.diagnose(reference, candidate, ec.compare(reference, candidate)).hint
    assert hint.startswith("everything matches at step 0 and diverges from step 1")
    assert "a scaling bug under clipping" in hint and "optimizer state" in hint


def test_a_mean_of_means_without_losses_is_not_blamed_on_zero_grad_with_an_equal_loss():
    (outcome,) = ec.check_step("mlp", lambda m, o, b: step(m, o, b, micro_batches=5, mean_of_means=True)).outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH
    assert outcome.comparison.hint.startswith("every gradient differs from step 0 (no losses were reported")
    assert "same loss" not in outcome.comparison.hint


# --- clipped references -------------------------------------------------------------------------------

def clipping_step(model, optimizer, batch, max_norm=0.3, per_micro_batch=False, micro_batches=4):
    """A team's step that clips before stepping, as nanoGPT does with grad_clip=1.0."""
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
        (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
        if per_micro_batch:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()


def test_a_clipping_step_matches_the_clipped_reference_and_says_clipping_engaged():
    (outcome,) = ec.check_step("mlp", clipping_step, reference="full_batch:max_norm=0.3").outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT
    assert "full_batch:max_norm=0.3: clipping engaged at 3 of 3 steps" in outcome.reason
    (plain,) = ec.check_step("mlp", clipping_step).outcomes  # against the unclipped reference: a real difference
    assert plain.verdict is ec.Verdict.MISMATCH


def test_its_twin_clipping_per_micro_batch_is_caught_against_the_clipped_reference():
    buggy = lambda m, o, b: clipping_step(m, o, b, per_micro_batch=True)  # noqa: E731
    (outcome,) = ec.check_step("mlp", buggy, reference="full_batch:max_norm=0.3").outcomes
    assert outcome.verdict is ec.Verdict.MISMATCH


def test_a_clipped_reference_that_never_clips_says_so():
    report = ec.check("mlp", ["accumulate:chunks=4,max_norm=10"], reference="full_batch:max_norm=10")
    (outcome,) = report.outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT
    assert "full_batch:max_norm=10.0: clipping engaged at 0 of 3 steps" in outcome.reason


@pytest.mark.parametrize("spec", ["full_batch:max_norm=0", "full_batch:max_norm=-1", "accumulate:chunks=2,max_norm=nan"])
def test_a_bad_max_norm_is_a_usage_error(spec):
    with pytest.raises(ec.InvalidArgument, match="max_norm="):
        ec.parse_regime(spec)


# --- a team's loop on DDP ranks -----------------------------------------------------------------------

def ddp_training_loop(model, optimizer, batches, zero_grad=True):
    """A loop as a team writes it for DDP: each rank its shard, the loss sum x W over the global batch."""
    import torch.distributed as dist

    losses = []
    for inputs, targets in batches:
        loss = F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / 12
        loss.backward()
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def ddp_loop_forgetting_zero_grad(model, optimizer, batches):
    return ddp_training_loop(model, optimizer, batches, zero_grad=False)


def test_a_loop_runs_on_ranks_and_its_twin_without_zero_grad_is_caught():
    (outcome,) = ec.check_loop("mlp", ddp_training_loop, world_size=2).outcomes
    assert outcome.verdict is ec.Verdict.EQUIVALENT
    assert outcome.regime == "ddp_loop:world_size=2,fn=test_real_models:ddp_training_loop"
    assert outcome.result.syncs == (1, 1, 1)
    (buggy,) = ec.check_loop("mlp", ddp_loop_forgetting_zero_grad, world_size=2).outcomes
    assert buggy.verdict is ec.Verdict.MISMATCH


def test_a_loop_for_ranks_must_be_importable_and_wrap_needs_ranks():
    with pytest.raises(ec.InvalidArgument, match="loop=.*a function, or an object bound to a name, at the top level of an importable module"):
        ec.check_loop("mlp", lambda model, optimizer, batches: None, world_size=2)
    with pytest.raises(ec.InvalidArgument, match="wrap=.* is not allowed without world_size"):
        ec.check_loop("mlp", ddp_training_loop, wrap=lambda model: model)


# --- a step with state across calls -------------------------------------------------------------------

def make_scheduled_step(decay=0.5, micro_batches=4):
    """A factory of a step that keeps a learning-rate schedule across calls, made on its first call."""
    state = {}

    def step(model, optimizer, batch):
        if "schedule" not in state:
            state["schedule"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: decay ** t)
        inputs, targets = batch
        for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
            (F.cross_entropy(model(x), y, reduction="sum") / len(targets)).backward()
        optimizer.step()
        optimizer.zero_grad()
        state["schedule"].step()

    return step


SCHEDULED_REFERENCE = ec.regimes.UserStep(lambda: make_scheduled_step(micro_batches=1), per_run=True)


def test_a_stateful_step_made_per_run_matches_a_reference_with_the_same_schedule():
    ec.check_step("mlp", make_scheduled_step, reference=SCHEDULED_REFERENCE, per_run=True).assert_equivalent()
    (wrong,) = ec.check_step("mlp", lambda: make_scheduled_step(decay=0.4), reference=SCHEDULED_REFERENCE,
                             per_run=True).outcomes
    # the learning rates part after step 0, the weights after step 1, so the gradients from step 2
    assert wrong.verdict is ec.Verdict.MISMATCH and wrong.comparison.first_divergent_step == 2


def test_state_kept_outside_a_run_leaks_into_the_next_one_which_is_why_per_run_exists():
    shared = make_scheduled_step()  # one step object for every run: its schedule stays bound to the first optimizer
    ec.check_step("mlp", shared, reference=SCHEDULED_REFERENCE).assert_equivalent()
    (second,) = ec.check_step("mlp", shared, reference=SCHEDULED_REFERENCE).outcomes
    assert second.verdict is ec.Verdict.MISMATCH
