"""pytorch/pytorch#187732: ``static_graph=True`` with ``no_sync()`` accumulation crashed, then stopped all-reducing.

With ``DistributedDataParallel(static_graph=True)`` and gradient accumulation under ``no_sync()``, DDP kept treating
every backward of the window as part of its first, graph-recording iteration: the first backward hit an internal
assert on ``expect_autograd_hooks_``, and with that assert out of the way the per-parameter hook counts grew with
every micro-batch, so from the second optimizer step on no parameter was ever marked ready and no gradient was
all-reduced. Each rank then stepped on its own micro-batches alone, where one process steps on the whole global
batch. The proposed fix enqueues the static graph's one delayed all-reduce only on a syncing backward and counts
hooks only where DDP expects them.
"""

import contextlib

import torch.nn.functional as F

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "pull", 187732, "ddp",
          "static_graph=True with no_sync() accumulation: internal assert, then gradients never all-reduced",
          not_expressible="on the installed torch 2.13 the regression shows only as its first half: the step below "
                          "under ddp_options={'static_graph': True} raises the expect_autograd_hooks_ INTERNAL ASSERT "
                          "on its first no_sync() backward, an error of the run rather than gradients that differ; "
                          "with a first step that syncs, later no_sync() windows all-reduce correctly (measured). "
                          "The silent loss of the all-reduce needs a torch with the assert lifted and the hook "
                          "counting unfixed, which no public argument selects")

ACCUMULATION_STEPS = 3  # each rank's 6 samples of mlp's 12: micro-batches of 2


def train_step(model, optimizer, batch):
    """Accumulation as the report runs it: no_sync() on every micro-batch but the last."""
    inputs, targets = batch
    for index, (x, y) in enumerate(zip(inputs.chunk(ACCUMULATION_STEPS), targets.chunk(ACCUMULATION_STEPS))):
        with contextlib.nullcontext() if index == ACCUMULATION_STEPS - 1 else model.no_sync():
            (F.cross_entropy(model(x), y) / ACCUMULATION_STEPS).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
