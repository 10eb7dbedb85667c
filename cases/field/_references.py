"""References the field's modules share: the training a reported step must equal, where plain full batch is not it."""

import torch
import torch.nn.functional as F


def clipped_once(max_norm):
    """A team that clips is held to one process taking the global batch's mean loss and clipping its whole gradient
    once, to ``max_norm``, before the step: what its code means, however it splits the batch or shards the model.
    Bind the step at a module's top level (``clipped_full_batch = clipped_once(0.1)``)."""

    def clipped_full_batch(model, optimizer, batch):
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return clipped_full_batch
