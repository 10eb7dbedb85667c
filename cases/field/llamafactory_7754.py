"""hiyouga/LlamaFactory#7754: get_rope_index kept only mask == 1: neat packing's later documents sat at position 1.

For Qwen2-VL's mRoPE LlamaFactory's multimodal collator computes ``position_ids`` with the model's
``get_rope_index``, passing the batch's ``attention_mask``. Under ``neat_packing`` that mask holds each slot's document
index in its pack (``[1, 1, 2, 2, 2, 0]``), and ``get_rope_index`` keeps only the slots where the mask is 1
(``input_ids[attention_mask[i] == 1]``, positions written back there alone), so the second and later documents of a
pack kept the placeholder position 1 on every token (the text-only branch, ``cumsum`` of the mask, counts them in
steps of 2: also wrong). The merged pull passes ``attention_mask >= 1``, every real token: positions then count over
the pack, which RoPE under neat_packing's block-diagonal mask turns into each document's own relative positions. The
row: a team's step packs each global batch's documents into packs of 16 slots with the neat-packing mask, the 4-D
block mask made from it, positions from the function below fed the mask as reported or as fixed, under a small
rotary LM; held to the same model on the documents padded one a row.
"""

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.packing import DOCUMENTS, PADDING, POSITIONS, TOKENS, pack
from equivcheck.suites.field import Bug
from equivcheck_cases.field._packing import DIM, HEADS, VOCAB, token_mean_step
from equivcheck_cases.packing import BATCH_SIZE, documents, real_tokens, token_losses

BUG = Bug("hiyouga/LlamaFactory", "pull", 7754, "packing",
          "neat-packing mask [1,1,2,2,2,0] fed to get_rope_index: documents after the first all at position 1",
          fix_acts="forward")

CUTOFF_LEN = 16  # the slots of a pack


def get_rope_index(input_ids, attention_mask):
    """Qwen2-VL's ``get_rope_index`` for text tokens, as the branch of a batch with images treats the mask: each row's
    slots where the mask is 1 numbered in order, every other slot left at 1. (mRoPE gives a text token the same index
    on its three axes: one is kept.)"""
    position_ids = torch.ones_like(input_ids)
    for i, row in enumerate(input_ids):
        kept = row[attention_mask[i] == 1]
        llm_positions = torch.arange(len(kept))
        position_ids[i, attention_mask[i] == 1] = llm_positions
    return position_ids


def neat_packing_mask(layout):
    """``PackedSupervisedDatasetProcessor``'s neat-packing attention mask: each slot's document index in its pack,
    from 1, and 0 on padding."""
    real = layout[:, DOCUMENTS] != PADDING
    return torch.where(real, ((layout[:, POSITIONS] == 0) & real).cumsum(-1), 0)


def prepare_4d_attention_mask(attention_mask_with_indices):
    """LlamaFactory's block-diagonal 4-D mask from the neat-packing mask: 0 where a slot attends (same document,
    causal), the dtype's minimum elsewhere."""
    slots = attention_mask_with_indices.shape[-1]
    expanded = attention_mask_with_indices[:, None, None, :].expand(-1, 1, slots, slots)
    allowed = (expanded == expanded.transpose(-1, -2)) & (expanded != 0)
    allowed &= torch.ones(slots, slots, dtype=torch.bool).tril()
    return torch.zeros(allowed.shape, dtype=torch.get_default_dtype()).masked_fill(
        ~allowed, torch.finfo(torch.get_default_dtype()).min)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class RotaryLM(nn.Module):
    """Qwen2's text path scaled down: token embeddings, one self-attention block whose queries and keys are rotated
    by ``position_ids`` (RoPE) under the 4-D mask as given, an MLP, a final norm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        head_dim = DIM // HEADS
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # rope_theta

    def rotary(self, x, position_ids):
        angles = position_ids[:, None, :, None].to(x.dtype) * self.inv_freq.to(x.dtype)
        angles = torch.cat([angles, angles], dim=-1)
        return x * angles.cos() + rotate_half(x) * angles.sin()

    def forward(self, input_ids, position_ids, attention_mask):
        x = self.tokens(input_ids)
        rows, slots, _ = x.shape
        q, k, v = (part.view(rows, slots, HEADS, DIM // HEADS).transpose(1, 2) for part in self.qkv(x).chunk(3, -1))
        q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.to(x.dtype))
        x = x + self.out(mixed.transpose(1, 2).reshape(rows, slots, DIM))
        x = x + self.mlp(x)
        return self.norm(x) @ self.tokens.weight.T


def padded_forward(model, layout, targets):
    """The reference: each document alone in its row, at its own positions, its mask made as a pack's."""
    return model(layout[:, TOKENS], layout[:, POSITIONS], prepare_4d_attention_mask(neat_packing_mask(layout)))


CASE = ec.Case(name="field_llamafactory_7754", model=RotaryLM, data=documents, loss=token_losses, items=real_tokens,
               forward=padded_forward, batch_size=BATCH_SIZE, steps=2,
               description="packed_documents' documents under a small rotary LM fed token ids, position_ids and a "
                           "4-D block mask")


def neat_packing_step(model, optimizer, batch, every_real_token):
    packs, labels = pack(*batch, CUTOFF_LEN)
    input_ids, attention_mask = packs[:, TOKENS], neat_packing_mask(packs)
    # the collator: position_ids from get_rope_index, then the mask made 4-D for the block-diagonal attention
    rope_mask = (attention_mask >= 1).long() if every_real_token else attention_mask
    position_ids = get_rope_index(input_ids, rope_mask)
    return token_mean_step(model, optimizer, input_ids, position_ids, labels, prepare_4d_attention_mask(attention_mask))


def train_step_as_reported(model, optimizer, batch):
    return neat_packing_step(model, optimizer, batch, every_real_token=False)


def train_step(model, optimizer, batch):
    return neat_packing_step(model, optimizer, batch, every_real_token=True)


def buggy():
    return ec.check_step(CASE, train_step_as_reported)


def fixed():
    return ec.check_step(CASE, train_step)
