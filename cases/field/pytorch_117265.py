"""pytorch/pytorch#117265: a backward pre-hook registered after the first compiled call was silently never run.

The report compiles a function that calls an ``nn.Linear`` (``torch.compile(backend="aot_eager", fullgraph=True)``),
calls it once, then registers ``register_full_backward_pre_hook`` on the layer with a hook that doubles the
gradient flowing into it, and calls the function again: the compiled graph of the first call was reused, so the hook
never ran and the input's gradient came out as it was before the hook, where eager doubles it. Dynamo installs no
guard on a module's hook dictionaries by default (``torch._dynamo.config.skip_nnmodule_hook_guards = True``, for
guard overhead), so a hook added or removed after compiling goes unnoticed. Pull #186507 ("Invalidate Dynamo caches
when module hooks change") addresses it in torch; the installed torch 2.13 still reproduces the report (measured:
the input's gradient without the hook's factor). A team on 2.13 turns the guards on: ``skip_nnmodule_hook_guards =
False`` makes the registration recompile (measured equivalent). Here the team's step compiles mlp with aot_eager
and, from its second step on (after a warm-up step), scales the gradient reaching the head by 0.5 with a full
backward pre-hook; the reference is the same step run eagerly, where the hook runs from the step it is added.
"""

import weakref

import torch
import torch._dynamo
import torch.nn.functional as F

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "issue", 117265, "compile",
          "full_backward_pre_hook registered after the first compiled call: the cached graph never runs it",
          fixed_by="on torch 2.13, skip_nnmodule_hook_guards=False (in torch: pull #186507)", fix_acts="compiler")

HEAD_GRADIENT_SCALE = 0.5
WARM_UP_STEPS = 1


def scale_head_gradient(module, grad_output):
    return tuple(g * HEAD_GRADIENT_SCALE for g in grad_output)


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
    run = RUNS.get(optimizer)
    if run is None:
        run = RUNS[optimizer] = Training(model, compiled, guards_hooks)
    if run.steps == WARM_UP_STEPS:  # warm-up over: the head's gradient is scaled from now on
        model[2].register_full_backward_pre_hook(scale_head_gradient)
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
