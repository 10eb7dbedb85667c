"""How an RL trainer's per-token loss is aggregated into one objective, declared once: ``ec.Aggregated``.

Post-training losses are per token (a policy-gradient surrogate, a KL penalty, a value loss, each with its mask of
response tokens), and the trainers aggregate them in one of four ways (verl's ``loss_agg_mode`` names them):

- ``token-mean``: the mean over every response token of the global batch;
- ``seq-mean-token-mean``: each sequence's mean over its tokens, then the mean over the sequences that have any;
- ``seq-mean-token-sum``: each sequence's sum over its tokens, then the mean over the sequences;
- ``seq-mean-token-sum-norm``: the same sums divided by a constant ``length`` (Dr. GRPO's maximum response length)
  before the mean over the sequences.

Each is the mean over the global batch of one value per *unit* (a token, or a sequence), which is what a case's
``loss`` and ``items`` (or a :class:`~equivcheck.case.Term`'s ``loss`` and ``units``) declare: every regime adds each
micro-batch's (and each rank's) sum of those values over the global batch's count, so accumulation, DDP, FSDP2 and a
team's step that does the same are held to the one global objective, and a trainer that normalises by the
micro-batch's own count, or its rank's, parts from it (the pitfalls beside the built-in RL case, ``cases/rl.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import Tensor

from .errors import InvalidArgument, expect_callable, expect_int

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclasses.dataclass(frozen=True)
class Aggregated:
    """A per-token loss aggregated as ``mode`` says: ``per_token(output, targets)`` gives a ``(sequences, tokens)``
    loss, ``mask(targets)`` the 0/1 tokens that count; ``length`` is ``seq-mean-token-sum-norm``'s constant.
    :meth:`loss` and :meth:`units` are a case's ``loss`` and ``items`` (a term's ``loss`` and ``units``)."""

    per_token: Callable[[object, Tensor], Tensor]
    mask: Callable[[Tensor], Tensor]
    mode: str = "token-mean"
    length: int = 0

    def __post_init__(self) -> None:
        expect_callable("per_token", self.per_token)
        expect_callable("mask", self.mask)
        if self.mode not in MODES:
            raise InvalidArgument.value("mode", self.mode, f"one of {', '.join(map(repr, MODES))}")
        if self.mode == "seq-mean-token-sum-norm":
            expect_int("length", self.length, minimum=1)
        elif self.length:
            raise InvalidArgument.value("length", self.length,
                                        "0 (left out): only 'seq-mean-token-sum-norm' divides by a constant length")

    def loss(self, output: object, targets: Tensor) -> Tensor:
        """One value per unit of the batch: each counted token's loss, or each sequence's aggregate."""
        losses, mask = self.per_token(output, targets), self.mask(targets).to(bool)
        if self.mode == "token-mean":
            return losses[mask]
        sums = losses.where(mask, 0).sum(-1)
        if self.mode == "seq-mean-token-mean":
            counts = mask.sum(-1)
            return (sums / counts.clamp(min=1))[counts > 0]
        return sums if self.mode == "seq-mean-token-sum" else sums / self.length

    def units(self, targets: Tensor) -> int:
        """How many units the batch holds: its counted tokens, its sequences with any, or its sequences."""
        mask = self.mask(targets).to(bool)
        if self.mode == "token-mean":
            return int(mask.sum())
        if self.mode == "seq-mean-token-mean":
            return int(mask.any(-1).sum())
        return len(targets)
