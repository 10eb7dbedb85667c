"""Seed 004's printed figures: gradient -20 and weight 1.2, under every regime of the case."""

import pytest
import torch

import equivcheck as ec


@pytest.mark.parametrize("regime", ec.regimes_for(ec.get_case("seed004_linear")))
def test_seed004_gradient_and_weight(regime):
    result = ec.run("seed004_linear", regime)
    assert result.optimizer_steps == 1
    torch.testing.assert_close(result.grads[0]["weight"], torch.tensor([-20.0], dtype=torch.float64))
    torch.testing.assert_close(result.weights["weight"], torch.tensor([1.2], dtype=torch.float64))
    assert result.losses == pytest.approx([(16 + 4) / 2])  # residuals 4 and 2 at weight 1
