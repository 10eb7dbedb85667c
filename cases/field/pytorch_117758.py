"""pytorch/pytorch#117758: forward hooks registered once a compiled model had run were silently never called.

The report wraps a model in ``torch.compile``, optionally calls it once, then registers forward hooks on its
``nn.Linear`` layers and calls it again: the hooks run when they were registered before the first call and never when
registered after it. It is not when ``torch.compile()`` is called that matters but when the first compilation is
triggered: Dynamo installs no guard on a module's hook dictionaries by default
(``torch._dynamo.config.skip_nnmodule_hook_guards = True``, documented as a promise not to add or remove hooks after
compiling), so the graph compiled without the hook is reused. The report asked for the hooks to run, or at least a
warning. The installed torch 2.13 still reproduces it (measured: a forward hook added after the first compiled call
leaves the output as it was); the backward pre-hook of #117265 is the same gap for another kind of hook (its own
row). A team on 2.13 turns the guards on: ``skip_nnmodule_hook_guards = False`` makes the registration recompile
(measured equivalent). Here the team's step compiles mlp with ``aot_eager`` and, from its second step on (after a
warm-up step), scales the first layer's output by 0.5 with a forward hook; the reference is the same step run
eagerly, where the hook runs from the step it is added.
"""

import weakref

import torch
import torch._dynamo
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 117758, "compile",
          "forward hook registered after the first compiled call: the graph traced without it reused, never run",
          fixed_by="on torch 2.13, skip_nnmodule_hook_guards=False", fix_acts="compiler")

FIRST_LAYER_SCALE = 0.5
WARM_UP_STEPS = 1


def scale_output(module, inputs, output):
    return output * FIRST_LAYER_SCALE


class Training:
    """A run's state: the module it calls (compiled or not) and how many steps it has taken."""

    def __init__(self, model, compiled, guards_hooks):
        self.steps = 0
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.config.skip_nnmodule_hook_guards = not guards_hooks
            model = torch.compile(model, backend="aot_eager")
        self.forward = model


RUNS = weakref.WeakKeyDictionary()  # the run that owns each optimizer: started with it


def step_with(model, optimizer, batch, compiled=True, guards_hooks=True):
    if optimizer not in RUNS:
        RUNS[optimizer] = Training(model, compiled, guards_hooks)
    run = RUNS[optimizer]
    if run.steps == WARM_UP_STEPS:  # warm-up over: the first layer's output is scaled from now on
        model[0].register_forward_hook(scale_output)
    inputs, targets = batch
    loss = F.cross_entropy(run.forward(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.steps += 1
    return loss.detach()


def train_step(model, optimizer, batch):
    """As fixed on torch 2.13: the module's hook dictionaries guarded, so the new hook recompiles."""
    return step_with(model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    """Dynamo's default: no guard on the hook dictionaries."""
    return step_with(model, optimizer, batch, guards_hooks=False)


def eager(model, optimizer, batch):
    """The reference: the same step, not compiled."""
    return step_with(model, optimizer, batch, compiled=False)


def _check(step):
    default = torch._dynamo.config.skip_nnmodule_hook_guards
    try:
        return ec.check_step("mlp", step, eager)
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = default  # as it was, for whatever runs next


def buggy():
    return _check(train_step_as_reported)


def fixed():
    return _check(train_step)
