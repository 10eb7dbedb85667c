"""pytorch/pytorch#139476: a compiled module reused a frame compiled with a parameter frozen after unfreezing it.

The report trains a compiled module whose ``adjust_model`` sets ``requires_grad`` of ``layer2``'s parameters to False
on even iterations and back to True on odd ones (its ``forward`` also counts the iterations on ``self.num_iter``).
Dynamo re-used the frame it had compiled for the frozen parameters once they were trainable again: the unfrozen
``layer2`` got no gradient, silently, where eager gives it one. The row is not checked (``not_expressible``): the
installed torch 2.13 no longer reproduces it. Measured with the report's module and schedule (hidden size 16, four
iterations, ``aot_eager`` and ``inductor``): on every unfrozen iteration the compiled module's ``layer2`` has a
gradient, and ``layer1.bias``'s gradient equals eager's, as eager on every frozen one.
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 139476, "compile",
          "requires_grad toggled between compiled calls: the frozen frame reused, unfrozen params got no grad",
          not_expressible="fixed in the installed torch 2.13: the behaviour no longer reproduces (measured with the "
                          "report's module and freeze/unfreeze schedule under aot_eager and inductor: the unfrozen "
                          "layer2 gets its gradient and every gradient equals eager's). Checking it needs a torch from "
                          "before the fix; no team code differs between the run as reported and a fixed one")
