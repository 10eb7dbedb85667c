"""OpenNMT/OpenNMT-py#1171: under truncated BPTT each truncation restarted the decoder from its initial state.

With ``-truncated_decoder`` the trainer cuts each target sequence into truncations, runs forward and backward on
each in turn and detaches the decoder state between them, so the gradient stops at a truncation boundary while
the forward carries on where the previous truncation stopped. After a refactoring the model re-initialised the
decoder state at every truncation (the trainer no longer told it ``bptt=True`` after the first), so each later
truncation decoded from a fresh state, as if the sentence began there: another function than the decoder's.
Truncated BPTT over the whole batch computes every token from the state the sequence reached, with the gradient
cut at the boundaries. The fix passes the ``bptt`` flag again, so truncations after the first continue from the
carried (detached) state. The reference is that truncated-BPTT gradient, computed in one forward and backward.
"""

import torch
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("OpenNMT/OpenNMT-py", "pull", 1171, "accumulation",
          "truncated BPTT re-initialised the decoder state at every truncation instead of carrying it",
          fix_acts="forward 0")

TRUNC_SIZE = 2  # gru_decoder's 5 target tokens: truncations of 2, 2 and 1


def model_forward(model, tokens, state, bptt=False):
    """The model's forward over one truncation: the decoder state is initialised unless it continues (bptt)."""
    decoder, generator = model[0], model[1]
    if bptt is False:
        state = decoder.initial_hidden(tokens)  # init_state
    states = []
    for t in range(tokens.shape[1]):
        state = decoder.step(tokens[:, t], state)
        states.append(state)
    return generator(torch.stack(states, dim=1)), state


def train_step(model, optimizer, batch, carry_state=True):
    tokens, targets = batch
    normalization = targets.numel()  # the batch's target tokens
    state, bptt = None, False
    for j in range(0, tokens.shape[1], TRUNC_SIZE):
        logits, state = model_forward(model, tokens[:, j:j + TRUNC_SIZE], state, bptt=bptt)
        bptt = carry_state  # as reported: never set, every truncation starts afresh
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, j:j + TRUNC_SIZE].flatten(), reduction="sum")
        (loss / normalization).backward()
        state = state.detach()  # truncated BPTT: no gradient into the previous truncation
    optimizer.step()
    optimizer.zero_grad()


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, carry_state=False)


def truncated_bptt(model, optimizer, batch):
    """The reference: one forward over the whole sequence, the state detached at every truncation boundary, one
    backward of the mean over every target token."""
    tokens, targets = batch
    decoder, generator = model[0], model[1]
    state, states = decoder.initial_hidden(tokens), []
    for t in range(tokens.shape[1]):
        if t and t % TRUNC_SIZE == 0:
            state = state.detach()
        state = decoder.step(tokens[:, t], state)
        states.append(state)
    logits = generator(torch.stack(states, dim=1))
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def buggy():
    return ec.check_step("gru_decoder", train_step_as_reported, reference=truncated_bptt)


def fixed():
    return ec.check_step("gru_decoder", train_step, reference=truncated_bptt)
