"""Seed 002's ``loss += item_loss``: the accumulation that keeps every micro-batch's graph alive.

The loop looks like gradient accumulation (a forward per micro-batch, each loss scaled by the
global item count) but sums the losses and calls backward once, after the last forward. The
gradients are exact; the memory is that of the full batch, because every graph waits for that one
backward. equivcheck must say both: equivalent, and "accumulates gradients but saves no memory".
"""

from __future__ import annotations

import dataclasses

from .regimes import Chunked, chunk_pairs, finish_step, global_mean_part, register_regime


@register_regime
@dataclasses.dataclass(frozen=True)
class SummedLoss(Chunked):
    name = "summed_loss"
    summary = "seed 002's `loss += item_loss` over K micro-batches, one backward: exact, saves no memory"

    def train_step(self, model, optimizer, batch, objective):
        part_loss = global_mean_part(objective, batch)
        loss = 0.0
        for x, y in chunk_pairs(batch, self.chunks):
            loss += part_loss(model(x), y)  # the graph of every micro-batch stays alive until backward
        objective.backward(loss)  # through the precision mode's loss scaler, like every regime
        finish_step(optimizer, objective)
        return loss.detach()

