"""vllm-project/speculators#942: each rank divided the draft loss by its own supervised tokens before DDP's mean.

speculators' ``loss_function`` reduces a draft model's per-position loss (``kl_div_loss`` against the verifier's
logits by default) over a packed ``[1, seq_len]`` batch as ``sum(elementwise_loss) / (loss_mask.sum() + eps)``, the
rank's own supervised-token count; DDP (or FSDP) then averages the ranks' gradients. The pull's commit message: the
objective becomes the mean over ranks of per-rank ratios, biased whenever the ranks hold different numbers of
supervised tokens, which they routinely do (on an 8-rank DSpark run the counts spanned 1.194x, some steps had a rank
with none, and a token on the lightest rank weighed about 19% more). The pull's ``global_token_weighted_mean``
all-reduces the detached token count over the ranks and returns this rank's loss sum over that count times
``world_size``, cancelling the mean over ranks; with no process group, or one rank, the per-rank path is unchanged.
Scaled down: a tiny draft model distilled with ``kl_div_loss`` from a verifier's logits (drawn at random) on
sequences of 8 to 32 supervised tokens, each rank's 6 sequences reduced as one packed row, 2 DDP ranks (the trainer's
non-FSDP path, its clip at norm 1.0 left out), held to one process's token mean over the global batch.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("vllm-project/speculators", "pull", 942, "ddp",
          "draft loss / the rank's own supervised tokens, then DDP's mean: a mean of per-rank ratios",
          fix_acts="loss")

VOCAB, DIM, MAX_LEN, PAD = 16, 8, 32, 0
SAMPLES, BATCH_SIZE = 24, 12
MASK = VOCAB  # the target channel after the verifier's logits: the loss mask
_LOSS_REDUCTION_EPS = 1e-5


def draft_model():
    return nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, DIM), nn.Tanh(),
                         nn.Linear(DIM, VOCAB))


def draft_data():
    """Sequences of 8 to 32 tokens, padded; per position the verifier's logits (drawn at random) and the loss mask."""
    generator = torch.Generator().manual_seed(942)
    lengths = torch.randint(8, MAX_LEN + 1, (SAMPLES,), generator=generator)
    real = torch.arange(MAX_LEN) < lengths[:, None]
    tokens = torch.where(real, torch.randint(1, VOCAB, (SAMPLES, MAX_LEN), generator=generator), PAD)
    verifier_logits = 2 * torch.randn(SAMPLES, MAX_LEN, VOCAB, generator=generator, dtype=torch.float64)
    return tokens, torch.cat([verifier_logits, real[..., None].to(torch.float64)], dim=-1)


def kl_div_loss(logits, targets):
    """speculators' ``kl_div_loss`` per position: KL from the draft's distribution to the verifier's."""
    log_probs = F.log_softmax(logits, dim=-1)
    target_p = F.softmax(targets, dim=-1)
    return F.kl_div(log_probs, target_p, reduction="none", log_target=False).sum(dim=-1)


def supervised_kl(logits, targets):
    return kl_div_loss(logits, targets[..., :MASK]) * targets[..., MASK]


def supervised_tokens(targets):
    return int(targets[..., MASK].sum())


DRAFT = ec.register_case(ec.Case(
    name="field_draft_kl", model=draft_model, data=draft_data, loss=supervised_kl, items=supervised_tokens,
    batch_size=BATCH_SIZE, steps=SAMPLES // BATCH_SIZE,
    description="a draft model distilled from a verifier's logits: the KL per supervised position, averaged over the "
                "global batch's supervised tokens"))


def global_token_weighted_mean(numerator, mask_sum):
    """The pull's helper: this rank's loss sum over the ranks' supervised tokens, times world_size; None with one
    process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    global_den = mask_sum.detach().clone()
    dist.all_reduce(global_den, op=dist.ReduceOp.SUM)
    return numerator / (global_den + _LOSS_REDUCTION_EPS) * dist.get_world_size()


def loss_function(logits, targets, loss_mask, global_normalization=True):
    """speculators' ``loss_function`` on a packed ``[1, seq_len]`` batch (no decay)."""
    elementwise_loss = kl_div_loss(logits, targets)  # shape: [1, seq_len]
    loss_mask = loss_mask.to(elementwise_loss.dtype)
    elementwise_loss = elementwise_loss * loss_mask
    if global_normalization:  # the pull
        global_mean = global_token_weighted_mean(elementwise_loss.sum(), loss_mask.sum())
        if global_mean is not None:
            return global_mean
    denominator = loss_mask.sum(dim=1) + _LOSS_REDUCTION_EPS
    batch_loss = torch.sum(elementwise_loss, dim=1) / denominator  # shape: [1]
    return batch_loss.mean()


def train_step(model, optimizer, batch, global_normalization=True):
    input_ids, targets = batch
    logits = model(input_ids)
    logits, targets = logits.reshape(1, -1, VOCAB), targets.reshape(1, -1, VOCAB + 1)  # packed: the rank in one row
    loss = loss_function(logits, targets[..., :MASK], targets[..., MASK], global_normalization)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


train_step_as_reported = functools.partial(train_step, global_normalization=False)


def buggy():
    return ec.check_step(DRAFT, train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step(DRAFT, train_step, world_size=2)
