"""pytorch/pytorch#69031: with ``find_unused_parameters=True``, ``no_sync()`` left some gradients unreduced.

DDP with ``find_unused_parameters=True`` decided which parameters took part in an iteration from the autograd graph
of the syncing forward alone. Under gradient accumulation with ``no_sync()``, a parameter used in an earlier
micro-batch of the window but not in the last one was marked unused, so the gradient it had accumulated on each rank
was never all-reduced: every rank stepped that parameter with its own micro-batches' gradient (stochastic depth and
routed experts trip it), where one process steps with the gradient of the whole global batch. The fix, in DDP's
reducer, records which parameters were used on every backward, syncing or not, so all of them are reduced.
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 69031, "ddp",
          "find_unused_parameters with no_sync(): parameters used only in earlier micro-batches never reduced",
          fixed_by="pull #124193",
          not_expressible="the bug and its fix live inside DDP's reducer, and the installed torch 2.13 has the fix: "
                          "no_sync() accumulation over 3 micro-batches on the built-in case routed_experts (its rare "
                          "expert sits out each rank's last micro-batch) with ddp_options={'find_unused_parameters': "
                          "True} is found equivalent (measured). Catching it would need a torch from before the fix; "
                          "no team code differs between the buggy and the fixed runs")
