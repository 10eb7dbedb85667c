"""ApolloResearch/e2e_sae#70: pull #68 stopped dividing each accumulation step's loss by the accumulation steps.

e2e_sae trains sparse autoencoders with gradient accumulation: each of ``n_gradient_accumulation_steps`` batches'
loss is backpropagated before one optimizer step. Pull #68 removed the line ``loss = loss /
n_gradient_accumulation_steps`` (for results that do not depend on the effective batch size), and the gradients of
the accumulation steps, each loss being a mean over its batch, then added up to that many times the effective
batch's mean gradient. Pull #70 reverts it, saying why: the losses are means, so each must be divided by the number
of accumulation steps for the accumulated gradient to be the mean over the whole effective batch. Here the team's
step splits mlp's global batch of 12 into 3 accumulation batches of 4 and is held to one process taking the whole
batch's mean loss.
"""

import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("ApolloResearch/e2e_sae", "pull", 70, "accumulation",
          "accumulation steps' mean losses backpropagated undivided (pull #68): grads n_steps times too big",
          fix_acts="loss")

N_GRADIENT_ACCUMULATION_STEPS = 3  # mlp's 12 samples a step: 3 batches of 4


def train_step(model, optimizer, batch, divide=True):
    inputs, targets = batch
    total = 0.0
    for x, y in zip(inputs.chunk(N_GRADIENT_ACCUMULATION_STEPS), targets.chunk(N_GRADIENT_ACCUMULATION_STEPS)):
        loss = F.cross_entropy(model(x), y)
        if divide:
            loss = loss / N_GRADIENT_ACCUMULATION_STEPS
        loss.backward()
        total += loss.detach() if divide else loss.detach() / N_GRADIENT_ACCUMULATION_STEPS
    optimizer.step()
    optimizer.zero_grad()
    return total


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, divide=False)


def buggy():
    return ec.check_step("mlp", train_step_as_reported)


def fixed():
    return ec.check_step("mlp", train_step)
