"""openai/guided-diffusion#167: the repo's own checkpoint function re-ran the forward in backward with fresh RNG.

guided-diffusion checkpoints its blocks with a hand-written ``torch.autograd.Function``: ``forward`` runs the block
under ``no_grad`` and keeps only its inputs, ``backward`` runs the block again with gradients on and differentiates
that second run. Nothing saved or restored the RNG state between the two runs, so every dropout layer in the block
drew a new mask in backward: the gradient belonged to another sub-network than the loss it was meant for, and the
extra draws moved the global RNG stream, so later steps drew other masks as well. Training without checkpointing
differentiates the forward that produced the loss. The issue is still open; the fix it proposes, used here, stashes
the CPU RNG state in ``forward`` and re-runs the block in ``backward`` under ``torch.random.fork_rng`` with that
state restored, so the recomputation draws the same masks and leaves the global stream where the forward left it.
That proposal stashes the CPU generator only: on a GPU dropout draws from the device's generator, and equivcheck
with ``--device cuda`` catches the proposal as still wrong there (margin 2.4e+06, an H200). The fix here stashes the
generator of the device the block runs on, as ``torch.utils.checkpoint`` does.
"""

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._checkpointed import train_step_through

BUG = Bug("openai/guided-diffusion", "issue", 167, "checkpointing",
          "custom checkpoint Function recomputed blocks without restoring the RNG: new dropout masks",
          fix_acts="backward 5")


def checkpoint(func, inputs, params, flag, restores_rng=True):
    """guided-diffusion's ``nn.checkpoint``: ``flag`` turns checkpointing on."""
    if flag:
        args = tuple(inputs) + tuple(params)
        return CheckpointFunction.apply(func, len(inputs), restores_rng, *args)
    return func(*inputs)


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, length, restores_rng, *args):
        ctx.run_function = run_function
        ctx.input_tensors = list(args[:length])
        ctx.input_params = list(args[length:])
        ctx.device = args[0].device
        ctx.rng_state = _generator_state(ctx.device) if restores_rng else None  # the proposed fix, on any device
        with torch.no_grad():
            output_tensors = ctx.run_function(*ctx.input_tensors)
        return output_tensors

    @staticmethod
    def backward(ctx, *output_grads):
        ctx.input_tensors = [x.detach().requires_grad_(True) for x in ctx.input_tensors]
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.rng_state is not None), torch.enable_grad():
            if ctx.rng_state is not None:
                _set_generator_state(ctx.device, ctx.rng_state)
            shallow_copies = [x.view_as(x) for x in ctx.input_tensors]
            output_tensors = ctx.run_function(*shallow_copies)
        input_grads = torch.autograd.grad(output_tensors, ctx.input_tensors + ctx.input_params, output_grads,
                                          allow_unused=True)
        del ctx.input_tensors, ctx.input_params, output_tensors
        return (None, None, None) + input_grads


def _generator_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_generator_state(device, state):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def train_step(model, optimizer, batch, restores_rng=True):
    """Each block checkpointed as guided-diffusion's blocks are."""
    train_step_through(lambda block, hidden: checkpoint(block, (hidden,), block.parameters(), True, restores_rng),
                       model, optimizer, batch)


def train_step_as_reported(model, optimizer, batch):
    train_step(model, optimizer, batch, restores_rng=False)


def buggy():
    return ec.check_step("dropout_two_layers", train_step_as_reported)


def fixed():
    return ec.check_step("dropout_two_layers", train_step)
