"""Tensors as numpy arrays, for what crosses from a rank or a forked child: numpy has no bfloat16, so a bfloat16
tensor crosses as its bits, in an array type that says so, and comes back as the same bfloat16 tensor."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class BFloat16Bits(np.ndarray):
    """A bfloat16 tensor's bits, as int16: the array type is what tells them from an int16 tensor's values."""


def to_array(tensor: Tensor) -> np.ndarray:
    """A detached CPU copy of ``tensor`` as an array (a bfloat16 one as its bits)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().copy().view(BFloat16Bits)
    return tensor.numpy().copy()


def from_array(array: np.ndarray) -> Tensor:
    """The tensor :func:`to_array` made ``array`` of."""
    if isinstance(array, BFloat16Bits):
        return torch.from_numpy(array.view(np.ndarray)).view(torch.bfloat16)
    return torch.from_numpy(array)
