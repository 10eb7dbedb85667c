"""References shared by the framework tests: full-batch training clipped the way a framework clips."""

import torch
import torch.nn.functional as F

CLIP = 0.05  # below every step's gradient norm on the mlp case: the clipping bites in the reference too


def clipped_full_batch(model, optimizer, batches):
    """Full batch, the gradient norm clipped to CLIP once before each step (a check_loop loop)."""
    for inputs, targets in batches:
        F.cross_entropy(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
