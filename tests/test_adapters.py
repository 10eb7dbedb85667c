"""Adapters on a frozen base with a tied embedding (issue 67): LoRA written plainly, equivalent under accumulation,
DDP, FSDP2 and non-reentrant checkpointing; recomputation that cuts the adapters off and a tying broken by a trainable
copy of the output layer are caught."""

import torch
from torch.nn.parallel import DistributedDataParallel

import equivcheck as ec
from equivcheck import Verdict
from equivcheck_cases.adapters import head_to_save, lora_sp_block, lora_tied


def test_the_adapters_and_the_tied_embedding_train_alone_and_every_faithful_regime_is_equivalent():
    model = lora_tied.model()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"trunk.embed.weight", "trunk.block.0.lora_a", "trunk.block.0.lora_b",
                       "trunk.block.2.lora_a", "trunk.block.2.lora_b"}
    assert model.head.weight is model.trunk.embed.weight
    specs = [*lora_tied.regimes[1:], "ddp_no_sync:world_size=2,chunks=2"]
    outcomes = {o.regime: o for o in ec.check(lora_tied, specs).outcomes}
    for spec in specs:
        expected = Verdict.EXPECTED_MISMATCH if spec.startswith("checkpoint_reentrant") else Verdict.EQUIVALENT
        assert outcomes[spec].verdict is expected, outcomes[spec].describe()


def test_reentrant_recomputation_leaves_the_trunk_without_its_gradients_while_the_head_trains():
    (outcome,) = ec.check(lora_tied, ["checkpoint_reentrant:chunks=2"]).outcomes
    parted = {m.name for m in outcome.comparison.mismatches if m.kind == "grad"}
    assert outcome.comparison.margin > 1e3 and {"trunk.block.0.lora_a", "trunk.block.2.lora_b"} <= parted
    assert "trunk.embed.weight" in parted  # its own use's gradient lost; the head's use's kept
    assert "got no gradient (zeros) where the reference's carry one" in outcome.comparison.hint
    assert "reentrant checkpoint" in outcome.comparison.hint
    # where it parts is not said from a graph a reentrant checkpoint never kept, and why is said in its place
    assert outcome.location is None and "recomputed reentrant from token ids" in outcome.reason, outcome.describe()


def steps_once(model, optimizer, batch):
    """A team's DDP step: its shard's token losses summed over the global batch's real tokens, times the world size
    (DDP averages the ranks), one backward, one step."""
    tokens, targets = batch
    flat = targets.reshape(-1)
    counted = torch.tensor(float((flat != -100).sum()))
    torch.distributed.all_reduce(counted)
    losses = torch.nn.functional.cross_entropy(model(tokens).reshape(len(flat), -1), flat, ignore_index=-100,
                                               reduction="sum")
    loss = losses * torch.distributed.get_world_size() / counted
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def keeps_the_tying(model):
    """The team's DDP wrap, the model as it is."""
    return DistributedDataParallel(model)


def saves_the_head(model):
    """The same wrap after peft's modules_to_save=["head"] as it was: the output layer a trainable copy."""
    return DistributedDataParallel(head_to_save(model))


def test_a_trainable_copy_of_the_tied_output_layer_is_caught_in_the_embedding():
    """peft's modules_to_save before pull #2803: the head replaced by a copy of the tied weight, which the embedding
    then trains without; the same step with the tying kept is equivalent."""
    (kept,) = ec.check_step(lora_tied, steps_once, world_size=2, wrap=keeps_the_tying).outcomes
    assert kept.verdict is Verdict.EQUIVALENT, kept.describe()
    (untied,) = ec.check_step(lora_tied, steps_once, world_size=2, wrap=saves_the_head, locate=True).outcomes
    assert untied.verdict is Verdict.MISMATCH and untied.comparison.margin > 100, untied.describe()
    assert "trunk.embed.weight" in {m.name for m in untied.comparison.mismatches if m.kind == "grad"}
    location = untied.location  # the embedding's gradient lacks the head's use, what it is handed matching
    assert (location.step, location.phase, location.module) == (0, "backward", "trunk.embed"), untied.describe()


def test_adapters_under_tensor_and_sequence_parallelism_are_equivalent_and_their_base_stays_frozen():
    """Megatron's factor layout on a frozen block under tp_sp: the replicated factors (the column-parallel base's
    lora_a, the row-parallel base's lora_b) run on sequence shards, their gradients summed over TP by DTensor; the
    frozen norm, which torch's SequenceParallel replicates as trainable, is kept frozen, so nothing else trains."""
    model = lora_sp_block.model()
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {
        "up.lora_a.weight", "up.lora_b.weight", "down.lora_a.weight", "down.lora_b.weight", "head.weight",
        "head.bias"}
    outcomes = ec.check(lora_sp_block, lora_sp_block.regimes[1:-1]).outcomes
    assert all(o.verdict is Verdict.EQUIVALENT for o in outcomes), [o.describe() for o in outcomes]


def test_replicated_adapter_factors_not_summed_over_tensor_parallelism_are_caught_where_they_part():
    """mcore-bridge pull #173's class: each rank's replicated factor trained on its own half of the sequence."""
    (outcome,) = ec.check(lora_sp_block, ["tp_sp_norm_unreduced:world_size=2"], locate=True).outcomes
    assert outcome.verdict is Verdict.EXPECTED_MISMATCH and outcome.comparison.margin > 1e3, outcome.describe()
    first = {m.name for m in outcome.comparison.mismatches if m.kind == "grad" and m.first_step == 0}
    assert first == {"up.lora_a.weight", "down.lora_b.weight"}  # the rest part only once the replicas drift
    location = outcome.comparison.location
    assert (location.step, location.phase, location.module) == (0, "communication", "up.lora_a")
