"""A full-batch step of ``dropout_two_layers`` through checkpointed blocks, shared by the checkpointing reports: each
module brings its own way of checkpointing a block, which is what its report is about."""

import torch.nn.functional as F


def train_step_through(run_block, model, optimizer, batch):
    """One step: the case's two (Linear, Tanh, Dropout) blocks each run as ``run_block(block, hidden)``, then the head,
    the global batch's mean loss backpropagated once."""
    inputs, targets = batch
    hidden = inputs
    for block in (model[0:3], model[3:6]):
        hidden = run_block(block, hidden)
    F.cross_entropy(model[6](hidden), targets).backward()
    optimizer.step()
    optimizer.zero_grad()
