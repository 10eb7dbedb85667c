"""A case's ``clip_scale``: every ``clip_grad_norm_`` of a run clips at that fraction of the threshold its caller gave.

A clipping bug shows only where clipping engages, and a team's step often clips at a module constant
(``clip_grad_norm_(model.parameters(), 1.0)``) that a small case's gradients never reach. Scaling the threshold where
torch applies it (``torch.nn.utils.clip_grad._clip_grads_with_norm_``, which ``clip_grad_norm_`` calls by its module's
name however the caller imported it) makes the team's clipping and the reference's engage alike, with no change to
the team's code. The total norm is computed as before; only the threshold it is held to moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn.utils import clip_grad


@contextlib.contextmanager
def scaled(scale: float | None) -> Iterator[None]:
    """Within the block, every ``clip_grad_norm_`` clips at ``scale`` times its ``max_norm`` (None: as given)."""
    if scale is None:
        yield
        return
    original = clip_grad._clip_grads_with_norm_

    def clipping(parameters, max_norm, total_norm, foreach=None):
        return original(parameters, max_norm * scale, total_norm, foreach)

    clip_grad._clip_grads_with_norm_ = clipping
    try:
        yield
    finally:
        clip_grad._clip_grads_with_norm_ = original
