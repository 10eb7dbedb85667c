"""Does my case catch anything? The audit, as a user runs it, each blind reason beside a case that catches."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.cli import main

CATCHES, BLIND, NOT_APPLICABLE, NOT_RUN = (ec.Sensitivity.CATCHES, ec.Sensitivity.BLIND, ec.Sensitivity.NOT_APPLICABLE,
                                           ec.Sensitivity.NOT_RUN)
TOKENS = "token normalisation across micro-batches"
PER_RANK = "per-rank mean loss under DDP (token or shard imbalance)"
UNEVEN = "micro-batch mean / K, uneven micro-batches"
CLIPPING = "clipping per micro-batch"


@pytest.fixture(scope="module")
def audits():
    return {name: ec.audit(name) for name in ("mlp", "tokens", "seed004_linear", "batchnorm_cnn",
                                              "dropout_one_layer", "dropout_two_layers")}


def test_equal_length_samples_are_blind_to_token_normalisation_and_padded_tokens_catch_it(audits):
    blind, catches = audits["mlp"].finding(TOKENS), audits["tokens"].finding(TOKENS)
    assert blind.sensitivity is BLIND and blind.evidence == "every sample holds the same number of items (1)"
    assert catches.sensitivity is CATCHES and catches.margin > 100 and catches.regime.startswith("naive_accumulate")


def test_equal_shards_are_blind_to_a_per_rank_mean_and_token_imbalance_catches_it(audits):
    blind, catches = audits["mlp"].finding(PER_RANK), audits["tokens"].finding(PER_RANK)
    assert blind.sensitivity is BLIND
    assert blind.evidence.startswith("every rank's shard holds the same number of items (6) on 2 ranks")
    assert catches.sensitivity is CATCHES and catches.regime == "ddp_mean_loss:world_size=2" and catches.margin > 100


def test_a_batch_that_splits_only_evenly_is_blind_to_mean_over_k(audits):
    blind, catches = audits["seed004_linear"].finding(UNEVEN), audits["mlp"].finding(UNEVEN)
    assert blind.sensitivity is BLIND and blind.evidence == "every chunking tried splits batch_size 2 evenly"
    assert catches.sensitivity is CATCHES and catches.margin > 100


def test_batchnorm_and_dropout_are_audited_only_where_the_model_has_them(audits):
    assert audits["mlp"].finding("BatchNorm statistics per micro-batch").sensitivity is NOT_APPLICABLE
    assert audits["batchnorm_cnn"].finding("BatchNorm statistics per micro-batch").sensitivity is CATCHES
    assert audits["dropout_two_layers"].finding("dropout masks drawn per micro-batch").sensitivity is CATCHES
    one_layer = audits["dropout_one_layer"].finding("dropout masks drawn per micro-batch")
    assert one_layer.sensitivity is BLIND and "one dropout layer" in one_layer.evidence


def test_the_findings_are_the_classes_the_audit_probes(audits):
    """Each class of bug a pitfall regime declares is one the audit knows; those it probes are its findings."""
    from equivcheck.suites.audit import BUG_CLASSES, PROBED
    assert [f.pitfall for f in audits["mlp"].findings] == list(PROBED)
    assert {TOKENS, PER_RANK, UNEVEN, CLIPPING} <= set(PROBED) <= set(BUG_CLASSES)


def test_batchnorm_does_not_make_every_accumulation_pitfall_look_caught(audits):
    """Each pitfall is judged against its faithful twin: BatchNorm differs in both, equally."""
    assert audits["batchnorm_cnn"].finding(PER_RANK).sensitivity is BLIND


@pytest.mark.parametrize(("max_norm", "sensitivity"), [(1.0, BLIND), (0.1, CATCHES)])
def test_clipping_is_caught_only_where_the_threshold_engages(max_norm, sensitivity):
    case = dataclasses.replace(ec.get_case("mlp"), name="clipped_mlp", max_norm=max_norm)
    finding = ec.audit(case).finding(CLIPPING)
    assert finding.sensitivity is sensitivity
    if sensitivity is BLIND:
        assert finding.evidence.startswith("the reference's gradient norm (up to 0.41) never reaches max_norm (1)")
    found = ec.audit("mlp")
    assert found.finding(CLIPPING).sensitivity is NOT_APPLICABLE
    assert str(found) == found.describe() and str(found).startswith("audit of mlp: can it catch")  # print() gives the table


def test_an_unregistered_case_says_why_the_ddp_classes_were_not_run():
    case = dataclasses.replace(ec.get_case("tokens"), name="my_unregistered_tokens")
    finding = ec.audit(case).finding(PER_RANK)
    assert finding.sensitivity is NOT_RUN and "bound to none" in finding.evidence


# --- the warnings of check_step and check_loop -------------------------------------------------------

def mean_over_k_step(model, optimizer, batch, micro_batches=4):
    """The 2024 token-normalisation bug: each micro-batch's own mean, divided by K."""
    inputs, targets = batch
    for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
        loss = tokens_loss(model(x), y)
        (loss.sum() / len(loss) / micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad()


def tokens_loss(output, targets):
    return ec.get_case("tokens").loss(output, targets)


def test_the_token_bug_passes_on_equal_lengths_with_a_warning_and_is_caught_on_padded_tokens():
    same_lengths = dataclasses.replace(ec.get_case("tokens"), name="tokens_same_length",
                                       data=lambda: (torch.randint(1, 10, (24, 7)), torch.randint(1, 10, (24, 7))))
    with pytest.warns(ec.BlindSpotWarning, match="every sample holds the same number of items .7.") as seen:
        blind = ec.check_step(same_lengths, mean_over_k_step)
    assert seen[0].filename == __file__  # at the user's own call
    # the advice says what following it does to a step that averages per micro-batch: it fails, and why
    assert "the mean loss of each, divided by K) then fails, and rightly" in str(seen[0].message)
    assert blind.outcomes[0].verdict is ec.Verdict.EQUIVALENT
    caught = ec.check_step("tokens", mean_over_k_step)
    assert caught.outcomes[0].verdict is ec.Verdict.MISMATCH


def test_no_warning_where_the_case_can_show_it(recwarn):
    ec.check_loop("tokens", lambda model, optimizer, batches: [mean_over_k_step(model, optimizer, b) for b in batches])
    assert not [w for w in recwarn if issubclass(w.category, ec.BlindSpotWarning)]


def test_a_declared_max_norm_that_never_engages_is_warned_about(recwarn):
    def clipped_step(model, optimizer, batch):
        inputs, targets = batch
        F.cross_entropy(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    never = dataclasses.replace(ec.get_case("tokens"), name="tokens_clip_1", max_norm=1e3)
    with pytest.warns(ec.BlindSpotWarning, match=r"never reaches max_norm \(1000\)") as seen:
        ec.check_step(never, clipped_step, reference="full_batch")
    assert seen[0].filename == __file__
    recwarn.clear()
    engages = dataclasses.replace(ec.get_case("tokens"), name="tokens_clip_small", max_norm=1e-3)
    ec.check_step(engages, clipped_step)
    assert not [w for w in recwarn if issubclass(w.category, ec.BlindSpotWarning)]


# --- the command and the plugin -------------------------------------------------------------------

def test_the_command_prints_and_writes_every_finding(tmp_path, capsys):
    path = tmp_path / "audit.json"
    assert main(["audit", "--case", "seed004_linear", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "audit of seed004_linear" in out and "every chunking tried splits batch_size 2 evenly" in out
    rows = json.loads(path.read_text())
    assert {r["pitfall"] for r in rows} >= {TOKENS, UNEVEN, CLIPPING}
    assert next(r for r in rows if r["pitfall"] == UNEVEN)["sensitivity"] == "blind"
    assert main(["audit", "--case", "no_such_case"]) == 2


def test_the_fixture_fails_a_test_whose_case_cannot_catch_what_it_requires(pytester):
    pytester.makepyfile('''
def test_padded(equivcheck):
    equivcheck.audit("tokens", require=["token normalisation"])

def test_equal(equivcheck):
    equivcheck.audit("mlp", require=["token normalisation"])

def test_typo(equivcheck):
    equivcheck.audit("mlp", require=["tokn"])
''')
    result = pytester.runpytest()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 1 and outcomes.get("failed") == 2
    result.stdout.fnmatch_lines(["*case mlp cannot catch what this test requires:*",
                                 "*token normalisation across micro-batches: blind: every sample holds*",
                                 "*require='tokn' names no class of bug*"])


def test_only_a_case_with_a_smaller_last_batch_or_several_epochs_can_show_the_end_of_epoch_bugs(audits):
    pitfall = "end of epoch: the last, smaller window"
    blind = audits["mlp"].finding(pitfall)
    assert blind.sensitivity is BLIND and blind.evidence.startswith("every global batch is full and there is one epoch")
    tail = dataclasses.replace(ec.get_case("mlp"), name="mlp_with_a_tail", last_batch="keep", epochs=2,
                               data=lambda: (torch.randn(30, 6), torch.randint(0, 3, (30,))))
    finding = ec.audit(tail).finding(pitfall)
    assert finding.sensitivity is NOT_RUN and "check that loop with check_loop" in finding.evidence
