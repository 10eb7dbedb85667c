"""A reference's recording handed to worker ranks, which compare their runs with it as they train.

The parent writes it once per reference to a file; each rank maps that file (``torch.load(mmap=True)``), so its
pages are read as the comparison reaches them and held once in the page cache, whatever the number of ranks. The
file goes when the reference does (or at exit); nothing large crosses a pipe either way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch

from ...device import HOST
from ...judge.compare import Expected
from ...precision import Tolerance
from ...result import RunResult

REFERENCE_PREFIX = "equivcheck-reference-"
_written: dict[int, str] = {}  # id of a reference alive in this process -> its file


def payload(against: Expected) -> dict:
    """What a job carries of ``against``: the file of its reference (written now, if not yet) and its tolerance."""
    reference = against.reference
    if id(reference) not in _written:
        folder = tempfile.mkdtemp(prefix=f"{REFERENCE_PREFIX}{os.getpid()}-")  # whose it is, by name
        path = os.path.join(folder, "reference.pt")
        host = reference.to(HOST)  # an anchored check's reference may keep its recording on its GPU, or in files
        torch.save({"grads": [dict(step) for step in host.grads], "weights": dict(host.weights),
                    "buffers": dict(host.buffers)}, path)
        _written[id(reference)] = path
        weakref.finalize(reference, _remove, id(reference), folder)
    tolerance = against.tolerance
    return {"file": _written[id(reference)], "tolerance": (tolerance.rtol, tolerance.atol, tolerance.source)}


def _remove(key: int, folder: str) -> None:
    _written.pop(key, None)
    shutil.rmtree(folder, ignore_errors=True)


def expected(payload: dict) -> Expected:
    """On a rank: the reference mapped from its file, and the tolerance to compare at."""
    recording = torch.load(payload["file"], mmap=True, weights_only=True)
    reference = RunResult(case="", regime="", losses=(), grads=tuple(recording["grads"]),
                          weights=recording["weights"], buffers=recording["buffers"], seconds=0.0)
    return Expected(reference, Tolerance(*payload["tolerance"]))
