"""modelscope/ms-swift#10144: packed DPO averaged each micro-batch's pairs, then divided by the accumulation steps.

With packing, each micro-batch of ms-swift's DPO trainer is a pack holding as many preference pairs as fit, so the
micro-batches of one accumulation window hold different numbers of pairs. The pairwise loss was each micro-batch's
mean over its pairs, divided by the gradient accumulation steps: a 1-pair / 3-pair split weighted the pairs 1/2, 1/6,
1/6, 1/6 instead of 1/4 each. The merged pull has ``num_items_in_batch`` carry the window's preference-pair count,
averaged across ranks to undo DDP's mean of the gradients, and rescales the pairwise terms so that, after the
trainer's own division by the accumulation steps, a micro-batch's loss is the sum over its pairs over that count
(the step below writes that net). Scaled down: pairs of a shared prompt of 1 to 2 tokens and a chosen and a
rejected response of 1 to 3 tokens, under a policy and a frozen copy of its initial weights as the reference, sigmoid
DPO over the responses' summed log-probabilities; 2 ranks each pack their 6 pairs next fit into micro-batches of 12
slots (each pair whole, its chosen and rejected responses one after the other) and accumulate over their packs; held
to one process's mean over all the window's pairs, padded one sequence a row.
"""

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck.packing import DOCUMENTS, IGNORE, PADDING, pack, padded
from equivcheck.suites.field import Bug
from equivcheck_cases.field._rl import all_reduced, stepped, world_size
from equivcheck_cases.packing import LENGTH, VOCAB, DocumentLM

BUG = Bug("modelscope/ms-swift", "pull", 10144, "packing",
          "packed DPO: micro-batch means over unequal pair counts / GA weighted a 1|3 split 1/2, 1/6, 1/6, 1/6",
          fix_acts="loss")

PAIRS_IN_ALL, PAIRS_PER_STEP = 24, 12
BETA = 0.1
PACKING_LENGTH = 12  # the slots of a pack, one micro-batch


class PolicyAndReference(nn.Module):
    """The trained policy and the frozen reference policy (its initial weights), both reading the documents layout;
    the output stacks their logits, ``[..., 0, :]`` the policy's and ``[..., 1, :]`` the reference's."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = DocumentLM()
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)

    def forward(self, layout):
        with torch.no_grad():
            reference = self.reference(layout)
        return torch.stack([self.policy(layout), reference], dim=-2)


def preference_pairs():
    """24 pairs, each two documents one a row: prompt + chosen response, then prompt + rejected response, their
    prompt's targets ignored (only the responses' tokens are learnt)."""
    documents, prompts = [], []
    for _ in range(PAIRS_IN_ALL):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(1, 3, ())),))
        for _ in ("chosen", "rejected"):
            documents.append(torch.cat([prompt, torch.randint(1, VOCAB, (int(torch.randint(1, 4, ())),))]))
            prompts.append(len(prompt))
    layout, targets = padded(documents, LENGTH)
    for row, prompt in enumerate(prompts):
        targets[row, :prompt - 1] = IGNORE
    return layout, targets


def response_logps(output, targets):
    """Each slot's log-probability of its target under the policy and the reference, 0 where none: (..., 2)."""
    labels = targets.clamp(min=0)[..., None, None].expand(*targets.shape, 2, 1)
    logps = torch.log_softmax(output, dim=-1).gather(-1, labels).squeeze(-1)
    return logps * (targets != IGNORE)[..., None]


def dpo_loss(sequence_logps):
    """Sigmoid DPO per pair, from each sequence's summed log-probabilities (pairs' sequences chosen, rejected)."""
    policy, reference = sequence_logps.unbind(-1)
    logratios = (policy - reference).view(-1, 2)  # (pairs, chosen | rejected)
    return -F.logsigmoid(BETA * (logratios[:, 0] - logratios[:, 1]))


def padded_pair_losses(output, targets):
    """The objective: one loss per pair, each sequence its own padded row."""
    return dpo_loss(response_logps(output, targets).sum(1))


CASE = ec.register_case(ec.Case(
    name="field_ms_swift_10144", model=PolicyAndReference, data=preference_pairs, loss=padded_pair_losses,
    items=lambda targets: len(targets) // 2, batch_size=2 * PAIRS_PER_STEP, steps=PAIRS_IN_ALL // PAIRS_PER_STEP,
    description="DPO preference pairs (a prompt of 1 to 2 tokens, responses of 1 to 3) under a policy and its frozen "
                "initial copy as the reference, both reading the documents layout; the mean over the batch's pairs"))


def packed_micro_batches(layout, targets):
    """The pairs packed next fit into packs of PACKING_LENGTH slots, each pair whole: one pack a micro-batch."""
    groups, free = [[]], PACKING_LENGTH
    for pair in range(len(layout) // 2):
        slots = int((layout[2 * pair:2 * pair + 2, DOCUMENTS] != PADDING).sum())
        if slots > free:
            groups.append([])
            free = PACKING_LENGTH
        groups[-1].append(pair)
        free -= slots
    rows = [[row for pair in group for row in (2 * pair, 2 * pair + 1)] for group in groups]
    return [pack(layout[held], targets[held], PACKING_LENGTH) for held in rows]


def packed_pair_losses(output, layout, targets):
    """One loss per pair of a pack: each sequence's log-probabilities summed over its slots (its document id)."""
    logps = response_logps(output, targets)
    ids = layout[:, DOCUMENTS]
    real = ids != PADDING
    _, sequence = ids[real].unique(return_inverse=True)  # documents in id order: each pair's chosen, then rejected
    summed = logps.new_zeros(int(sequence.max()) + 1, 2).index_add(0, sequence, logps[real])
    return dpo_loss(summed)


def train_step(model, optimizer, batch, normalize_by_pairs=True):
    micro_batches = packed_micro_batches(*batch)
    gradient_accumulation_steps = len(micro_batches)
    # the fix: the window's pair count over every rank, averaged over the ranks (DDP averages their gradients)
    num_items_in_batch = all_reduced(len(batch[1]) // 2) / world_size()
    for index, (layout, targets) in enumerate(micro_batches):
        syncing = index == len(micro_batches) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if syncing else model.no_sync():  # DDP syncs on the last one
            losses = packed_pair_losses(model(layout), layout, targets)
            if normalize_by_pairs:
                loss = losses.sum() / num_items_in_batch
            else:  # as reported: the micro-batch's mean, divided by the accumulation steps
                loss = losses.mean() / gradient_accumulation_steps
            loss.backward()
    stepped(optimizer)


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, normalize_by_pairs=False)


def buggy():
    return ec.check_step(CASE, train_step_as_reported, world_size=2)


def fixed():
    return ec.check_step(CASE, train_step, world_size=2)
