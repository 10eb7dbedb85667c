"""pytorch/pytorch#180642: an in-place op inside a custom Function's forward sent its gradient to the wrong output.

The report saw a model with custom ops train far worse on torch 2.11 than on 2.10 under ``torch.compile``. The
reduced repro in the thread: an in-place op (``+=``) inside ``autograd.Function.forward``, together with a side effect
that captures the tensor before the mutation (a list append), made Dynamo's ``collect_intermediate_outputs`` add the
pre-mutation alias of the returned tensor as an extra subgraph output; sharing its ``TensorImpl``, it overwrote the
output's ``output_nr`` from 0 to 1, and the backward gradient went to the wrong slot (zero gradients). Pull #180921
filters such aliased intermediates (cherry-picked to 2.12). The row is not checked (``not_expressible``): the
installed torch 2.13 no longer computes the wrong gradient. Measured: a Function that doubles its input, appends the
result to a list and adds 1 in place now stops compilation with "An intermediate tensor ... aliases an input or
output ... clone the tensor before capturing it", an error rather than a gradient; without the append, compiled
gradients equal eager's (aot_eager and inductor).
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 180642, "compile",
          "in-place op in autograd.Function.forward plus a captured alias: output_nr rerouted, wrong gradient",
          fixed_by="pull #180921",
          not_expressible="fixed in the installed torch 2.13 (pull #180921): the wrong gradient no longer reproduces. "
                          "Measured: the in-place op with the pre-mutation tensor appended to a list raises Dynamo's "
                          "'intermediate tensor ... aliases an input or output' error (a failed run, not other "
                          "gradients), and without the append the compiled gradients equal eager's under aot_eager "
                          "and inductor. Checking it needs torch 2.11")
