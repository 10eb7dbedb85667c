"""pytorch/torchtitan#4637: a vocab-parallel embedding handed its global padding_idx to every rank's local shard.

TorchTitan's ``Embedding`` runs vocab-parallel under TP: each rank holds a contiguous slice of the vocabulary's
rows, shifts the token ids by its slice's offset, clamps them into range, looks them up in its local shard and masks
the tokens it does not own before the partial outputs are summed over the ranks. It passed ``self.padding_idx``, an
index into the whole vocabulary, to ``F.embedding`` on the local shard as it was. The forward is unchanged by it
(``padding_idx`` only stops the gradient of that row), but on every rank but the owner the index named another
token's row: with a low padding id (0 here) the rank holding the second half of the vocabulary never updated its
first row, a real token's embedding, while one process trains it (a high id raised an error instead). The fix maps
the padding index to local coordinates on its owning shard only and passes none elsewhere. Here a tiny token
model (the team's embedding, a hidden layer, a vocabulary head) runs on 2 TP ranks, the embedding's weight a DTensor
sharded by rows, over padded sequences whose pad id is 0.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._tensor import ReduceFromTensorParallelRegion, local, plain_sgd, shard_
from equivcheck_cases.tokens import DIM, PAD, VOCAB, token_losses, tokens

BUG = Bug("pytorch/torchtitan", "pull", 4637, "tensor",
          "vocab-parallel embedding passed the global padding_idx to local shards: another row's grad zeroed",
          fix_acts="backward tok_embeddings")


class Embedding(nn.Embedding):
    """TorchTitan's configurable embedding: the plain lookup in one process, vocab-parallel with a TP group; the
    masked partial outputs summed over the group (the plan's Partial output made Replicate)."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.tp_group = None
        self.local_padding_idx = True

    def forward(self, input):
        weight = local(self.weight)
        if self.tp_group is None:
            return F.embedding(input, weight, self.padding_idx)
        tp_size = dist.get_world_size(self.tp_group)
        chunk_size = (self.num_embeddings + tp_size - 1) // tp_size
        offset = dist.get_rank(self.tp_group) * chunk_size
        mask = (input >= offset) & (input < offset + weight.shape[0])
        local_input = (input - offset).clamp(0, weight.shape[0] - 1)
        padding_idx = self.padding_idx
        if self.local_padding_idx and padding_idx is not None:  # the fix: local coordinates, on the owner only
            owned = offset <= padding_idx < offset + weight.shape[0]
            padding_idx = padding_idx - offset if owned else None
        out = F.embedding(local_input, weight, padding_idx)
        return ReduceFromTensorParallelRegion.apply(out * mask.unsqueeze(-1).to(out.dtype), self.tp_group)


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(VOCAB, DIM, padding_idx=PAD)
        self.hidden = nn.Linear(DIM, DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.output(torch.tanh(self.hidden(self.tok_embeddings(tokens))))


vocab_parallel_embedding = ec.register_case(dataclasses.replace(
    tokens, name="field_vocab_parallel_embedding", model=TokenModel, optimizer=plain_sgd, split=None,
    regimes=("full_batch",),
    description="padded sequences (pad id 0) through an embedding with padding_idx, a hidden layer and a "
                "vocabulary head; the embedding vocab-parallel under TP"))


def tensor_parallel(model, mesh, local_padding_idx=True):
    """The embedding's rows sharded over mesh['tp'] (each rank half of the vocabulary); the rest replicated."""
    shard_(model.tok_embeddings, "weight", mesh["tp"], 0)
    model.tok_embeddings.tp_group = mesh["tp"].get_group()
    model.tok_embeddings.local_padding_idx = local_padding_idx
    return model


def tensor_parallel_as_reported(model, mesh):
    return tensor_parallel(model, mesh, local_padding_idx=False)


def train_step(model, optimizer, batch):
    """The mean loss over the batch's real tokens (every TP rank holds the same batch)."""
    inputs, targets = batch
    loss = token_losses(model(inputs), targets).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def buggy():
    return ec.check_step("field_vocab_parallel_embedding", train_step, mesh={"tp": 2},
                         parallelize=tensor_parallel_as_reported)


def fixed():
    return ec.check_step("field_vocab_parallel_embedding", train_step, mesh={"tp": 2}, parallelize=tensor_parallel)
