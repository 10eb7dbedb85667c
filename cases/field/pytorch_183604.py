"""pytorch/pytorch#183604: a custom autograd.Function applied to the same tensor twice got half its gradient compiled.

The report applies a custom ``torch.autograd.Function`` of two inputs, ``a * b + a + b`` with the backward
``(go * (b + 1), go * (a + 1))``, to one tensor passed as both inputs, ``F1.apply(x, x)``. Eager autograd adds the
gradients of both input slots into ``x.grad``; compiled with Inductor (torch 2.11) the result was exactly half of it,
one slot's contribution lost, with no error. The related #181146 reported the same collapse of aliased inputs to one
argument. The row is not checked (``not_expressible``): the installed torch 2.13 no longer reproduces it. Measured with
the report's Function and function on a float64 tensor of 5 elements: ``aot_eager`` and ``inductor`` give eager's
gradient, and #181146's variant (a backward that returns None for one of the two slots) does too.
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 183604, "compile",
          "F1.apply(x, x) compiled: the two aliased input slots' gradients collapsed to one, half of eager's",
          not_expressible="fixed in the installed torch 2.13: the behaviour no longer reproduces (measured with the "
                          "report's F1.apply(x, x) under aot_eager and inductor, and #181146's variant with a None "
                          "slot: the compiled gradients equal eager's). Checking it needs a torch from before the fix; "
                          "the team's code is the same before and after it")
