"""Seed 000: a cheap embedding trunk under a large, memory-hungry head, split for detached_partial; and the
same model on 2 DDP ranks (seed000_ddp), where the head is accumulated inside each rank's shard."""

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.catalogue import Entry, add_entry

VOCAB, DIM = 50, 16


def model():
    trunk = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM // 2), nn.Linear(DIM // 2, VOCAB))
    head = nn.Linear(VOCAB, VOCAB)
    for module in (*trunk, head):
        if isinstance(module, nn.Linear):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
    return nn.Sequential(trunk, head)


def data():
    return torch.randint(0, VOCAB, (24,)), torch.randint(0, VOCAB, (24,))


seed000_embedding_head = ec.register_case(ec.Case(
    name="seed000_embedding_head",
    model=model,
    data=data,
    loss=partial(F.cross_entropy, reduction="none"),
    batch_size=12,
    steps=2,
    split=lambda m: (m[0], m[1]),
    description="seed 000's embedding trunk + vocab x vocab head; detached_partial accumulates the head only",
))


# Seed 000's real question: the same trunk and head, the accumulation loop inside the GPU split.
SEED000_DDP = "world_size=2,chunks=3"
seed000_ddp = ec.register_case(dataclasses.replace(
    seed000_embedding_head,
    name="seed000_ddp",
    regimes=("full_batch", "ddp:world_size=2", f"ddp_detached_partial:{SEED000_DDP}",
             f"ddp_detached_partial_last_outside:{SEED000_DDP}", f"ddp_detached_partial_bypass:{SEED000_DDP}",
             f"ddp_detached_partial_in_forward:{SEED000_DDP}",
             f"ddp_detached_partial_sync_every_chunk:{SEED000_DDP}", "data_parallel_detached_partial:chunks=3"),
    expect_mismatch={
        "ddp_detached_partial_bypass": "the step reaches the trunk and head inside the DDP wrapper: never all-reduced",
        "ddp_detached_partial_in_forward": "DDP ignores the head's backward calls inside its own forward",
        "ddp_detached_partial_sync_every_chunk": "right gradients, but 4 all-reduces per step instead of 2",
    },
    description="seed 000 under DDP: the head accumulated over chunks of the detached trunk output on every rank",
))

# The catalogue's entries that use these cases.
add_entry(Entry("DDP partial accumulation reaching inside one wrapper (seed 000)", "seed000_ddp",
                "ddp_detached_partial_bypass:world_size=2,chunks=3"))
add_entry(Entry("DDP partial accumulation with backward inside the wrapped forward (seed 000)", "seed000_ddp",
                "ddp_detached_partial_in_forward:world_size=2,chunks=3"))
add_entry(Entry("DDP partial accumulation syncing the head every chunk (seed 000)", "seed000_ddp",
                "ddp_detached_partial_sync_every_chunk:world_size=2,chunks=3"))
