"""A run whose modules compute in another precision than its reference's is located at that precision, read from the
run (issue 65): the narrowest module holding every module that computed otherwise, no module's code claimed and no
pitfall hinted, with the argument that judges it. In process (a team's step that casts one block) and on FSDP2 ranks
(the most common recipe: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` on every block)."""

import pytest
import torch

import equivcheck as ec
from equivcheck.diff import COMPUTED_IN
from equivcheck.precision import PRECISIONS
from equivcheck.process import kernels

from precision_wraps import shard, shard_in_bf16
from test_locate_seen import CASE, full_batch
from test_team_parallel import DEFAULT_MESH_FITS, train_step


def casts_block_1_to_bf16(model, optimizer, batch):
    """The team's block 1 computes in bfloat16 inside a float64 model: its parameters cast for the forward, its output
    cast back."""
    block = model.blocks[1]
    if "forward" not in vars(block):
        plain = block.forward

        def forward(x):
            with torch.no_grad():
                saved = [p.data for p in block.parameters()]
                for p in block.parameters():
                    p.data = p.data.bfloat16()
            try:
                return plain(x.bfloat16()).double()
            finally:
                for p, data in zip(block.parameters(), saved):
                    p.data = data
        block.forward = forward
    full_batch(model, optimizer, batch)


def _bf16_kernels_run() -> bool:
    return kernels.probe(PRECISIONS["bf16-autocast"], kernels.DEFAULT) == "ran"


pytestmark = pytest.mark.usefixtures("locating")  # failed checks say where their runs part, as users get it


def test_a_block_the_step_computes_in_bf16_is_located_as_the_runs_precision():
    if not _bf16_kernels_run():
        pytest.skip("this CPU's default bf16 kernels die (oneDNN on AMX): a block cast to bf16 cannot run here")
    (outcome,) = ec.check_step(CASE, casts_block_1_to_bf16).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module, location.tensor) == (0, "forward", "blocks.1",
                                                                                  COMPUTED_IN), outcome.describe()
    assert "`blocks.1.act`, `blocks.1.fc1`, `blocks.1.fc2` computed in bfloat16, the reference's in float64" \
        in location.matched
    assert 'dtype="bf16-autocast"' in location.matched and not location.own_code
    assert not outcome.comparison.hint


@DEFAULT_MESH_FITS
def test_an_fsdp2_wrap_computing_in_bf16_is_named_as_the_runs_precision_not_the_models_code():
    if not _bf16_kernels_run():
        pytest.skip("this CPU's default bf16 kernels die (oneDNN on AMX): the FSDP2 bf16 wrap cannot run here")
    (outcome,) = ec.check_step("mlp", train_step, world_size=2, wrap=shard_in_bf16).outcomes
    location = outcome.location
    assert (location.step, location.phase, location.module, location.tensor) == (0, "forward", "", COMPUTED_IN), \
        outcome.describe()
    assert "`0`, `1`, `2` computed in bfloat16" in location.matched and 'dtype="bf16-autocast"' in location.matched
    assert not location.own_code and not outcome.comparison.hint
    assert ec.check_step("mlp", train_step, world_size=2, wrap=shard).outcomes[0].verdict is ec.Verdict.EQUIVALENT
