"""Cases and a planted regime for the dropout-on-ranks tests, in a module the ranks import by name."""

import dataclasses

import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.regimes import register_regime
from equivcheck.regimes.ddp import Ddp
from equivcheck.regimes.base import Regime
from equivcheck_cases.sequence_parallel import Block

BASE = ec.get_case("dropout_two_layers")
UNDECLARED = ec.register_case(dataclasses.replace(BASE, name="dropout_undeclared", expect_mismatch={}))


class FeaturesFirst(nn.Module):
    """Dropout on the transposed activations: the batch on dim 1, where no rank can find its rows."""

    def forward(self, x):
        return F.dropout(x.t(), 0.5, self.training).t()


SEQUENCE_FIRST = ec.register_case(dataclasses.replace(
    BASE, name="dropout_batch_second", expect_mismatch={},
    model=lambda: nn.Sequential(nn.Linear(6, 10), FeaturesFirst(), nn.Linear(10, 3))))


class Attention(nn.Module):
    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.qkv, self.dropout_p = nn.Linear(6, 18), dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).view(len(x), 3, 2, 3).unbind(1)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0)
        return out.reshape(len(x), 6)[:, :3]


ATTENTION_DROPOUT = ec.register_case(dataclasses.replace(
    BASE, name="dropout_in_attention_kernel", expect_mismatch={}, model=lambda: Attention(0.1)))
ATTENTION = ec.register_case(dataclasses.replace(
    BASE, name="dropout_attention_none", expect_mismatch={}, model=lambda: Attention(0.0)))


@register_regime
@dataclasses.dataclass(frozen=True)
class DdpUnaligned(Ddp):
    """The guard taken out: DDP whose ranks draw their shards' masks as they come, each from the shared seed."""

    name = "ddp_unaligned"
    summary = "DDP with dropout drawn by each rank for its own shard (no global batch's masks): a planted change"
    pitfall = True

    def random_streams(self, model, optimizer, inputs):
        return Regime.random_streams(self, model, optimizer, inputs)



class DroppedBlock(Block):
    """sp_block's block with dropout on the norm's output and on the MLP's, both run on sequence shards under SP."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.head(x + self.drop(self.down(self.act(self.up(self.drop(self.norm(x)))))))


SEQUENCE_DROPOUT = ec.register_case(dataclasses.replace(
    ec.get_case("sp_block"), name="dropout_on_sequence_shards", model=DroppedBlock, expect_mismatch={},
    tp_plan={"norm": "sequence", "drop": "sequence", "up": "colwise", "down": "rowwise"}))
