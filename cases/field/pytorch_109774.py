"""pytorch/pytorch#109774: compiled DDP with the Python reducer did not synchronize gradients unless DDP was compiled.

The issue tracks Compiled DDP: with ``torch._dynamo.config.optimize_ddp = "python_reducer"`` set before wrapping,
DDP launches one all-reduce per gradient from hooks that compiled autograd can trace. A user reported in the thread
that the wrapper itself had to be compiled: compiling a function that runs the DDP model's forward and backward,
with compiled autograd on but the DDP wrapper not compiled, left the gradients unsynchronized across ranks, with no
error. The row is not checked (``not_expressible``): the installed torch 2.13 no longer reproduces it. Measured on 2
gloo ranks (float64 MLP, different data per rank, ``python_reducer`` set before wrapping): the DDP wrapper compiled,
a compiled forward-and-backward function around the uncompiled wrapper, and the same with
``torch._dynamo.config.compiled_autograd = True`` all end with equal gradients on both ranks, as eager DDP does.
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 109774, "compile",
          "reported in the thread: python_reducer, fwd+bwd compiled but not the DDP wrapper: grads never synced",
          not_expressible="fixed in the installed torch 2.13: the behaviour no longer reproduces (measured on 2 gloo "
                          "ranks with optimize_ddp='python_reducer' set before wrapping: compiling the DDP wrapper, "
                          "compiling a forward-and-backward function around the uncompiled wrapper under compiled "
                          "autograd, and the same with compiled_autograd=True all leave equal gradients on both "
                          "ranks). Checking it needs a torch from before the fix; the team's code is the same before "
                          "and after it")
