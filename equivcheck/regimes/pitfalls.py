"""Pitfall regimes, each the way a real training loop goes wrong, beside the faithful twins that fix them.

A pitfall regime reproduces a bug people write; it declares the class of bug and its faithful twin on its
class (``pitfall = Pitfall(bug, twin=...)``). The harness must report it as a mismatch wherever the bug
changes the mathematics. Its twin does the same job the right way and must match full-batch training.
Most are the shared micro-batch loop with one difference (``loop.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..case import Batch, Objective, default_optimizer
from ..errors import InvalidArgument, expect_number
from ..process.seeding import DEFAULT_SEED, seeded
from .base import SCALED_TWICE, Chunked, Pitfall, Regime, finish_step, step_hooks
from .loop import accumulate, backward_chunks, global_mean_part, meddling_part


# The class of bug this module declares that suites/audit.py lists with its own.
TERMS_PER_MICRO_BATCH = "an added term normalised per micro-batch"


# --- the accumulation loop itself -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NaiveAccumulate(Chunked):
    name = "naive_accumulate"
    summary = "PITFALL: micro-batch mean / K; wrong whenever chunks or their item counts are uneven"
    pitfall = Pitfall(("micro-batch mean / K, uneven micro-batches", "token normalisation across micro-batches"),
                      twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        return accumulate(model, optimizer, batch, objective, self.chunks,
                          lambda output, targets: objective.mean(output, targets) / self.chunks)


@dataclasses.dataclass(frozen=True)
class TermsPerMicroBatch(Chunked):
    """The loss's share of the global batch right, the case's added terms (an RL trainer's KL penalty, its value
    loss) each normalised by the micro-batch's own units and divided by K: verl's critic loss, a token-mean per
    micro-batch summed over them (volcengine/verl pull #6957)."""

    name = "terms_per_micro_batch"
    summary = "PITFALL: the loss's share right, each added term (a KL, a value loss) a micro-batch mean / K"
    pitfall = Pitfall(TERMS_PER_MICRO_BATCH, twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        return accumulate(model, optimizer, batch, objective, self.chunks, lambda output, targets: (
            objective.share(output, targets, batch, terms_scale=0.0)
            + objective.terms_mean(output, targets) / self.chunks))


@dataclasses.dataclass(frozen=True)
class AccumulateDividedTwice(Chunked):
    """Each micro-batch's share of the global objective divided by the accumulation steps again: a loss normalised
    over the whole window, then by ``gradient_accumulation_steps`` as a trainer's loop divides (ms-swift#10117)."""

    name = "accumulate_divided_twice"
    summary = "PITFALL: each micro-batch's share of the global objective divided by K again: gradients 1/K"
    pitfall = Pitfall(SCALED_TWICE, twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        return accumulate(model, optimizer, batch, objective, self.chunks,
                          lambda output, targets: objective.share(output, targets, batch) / self.chunks)


@dataclasses.dataclass(frozen=True)
class ZeroGradInside(Chunked):
    name = "zero_grad_inside"
    summary = "PITFALL: optimizer.zero_grad() inside the accumulation loop: only the last micro-batch counts"
    pitfall = Pitfall("zero_grad inside the accumulation loop", twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        zeroing = meddling_part(optimizer.zero_grad, objective, batch)  # the bug: earlier parts thrown away
        return accumulate(model, optimizer, batch, objective, self.chunks, zeroing)


@dataclasses.dataclass(frozen=True)
class StepPerMicroBatch(Chunked):
    name = "step_per_micro_batch"
    summary = "PITFALL: optimizer.step() after every micro-batch: K small steps instead of one"
    pitfall = Pitfall("optimizer.step per micro-batch", twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        return backward_chunks(objective.forward_of(model), batch.inputs, batch.targets, self.chunks,
                               global_mean_part(objective, batch),
                               objective=objective, after=lambda: finish_step(optimizer, objective))


@dataclasses.dataclass(frozen=True)
class ClipPerMicroBatch(Chunked):
    """The case's optimizer clips once before each step (see ``clipping_optimizer``); this clips too early."""

    max_norm: float = 1.0
    name = "clip_per_micro_batch"
    summary = "PITFALL: clip_grad_norm_ after every micro-batch backward instead of once before the step"
    # Its twin clips once, before the step, through the case's optimizer (see clipping_optimizer): it takes the
    # pitfall's chunks but not its max_norm (accumulate's own max_norm would clip the sum a second time).
    pitfall = Pitfall("clipping per micro-batch", twin="accumulate:max_norm=inf")

    def __post_init__(self) -> None:
        super().__post_init__()
        expect_number("max_norm", self.max_norm, minimum=0, maximum=math.inf, strict=True)

    def train_step(self, model, optimizer, batch, objective):
        clipping = meddling_part(lambda: nn.utils.clip_grad_norm_(model.parameters(), self.max_norm), objective,
                                 batch)  # the bug: clips each partial sum
        return accumulate(model, optimizer, batch, objective, self.chunks, clipping)


def clipping_optimizer(max_norm: float, make=None):
    """An optimizer factory that clips the gradient norm to ``max_norm`` once, just before every step.

    This is a training loop's ``clip_grad_norm_(...); optimizer.step()``: every regime that steps once
    per global batch clips the whole accumulated gradient, which is the faithful way.
    """
    def build(params):
        optimizer = (make or default_optimizer)(params)  # as given: a ModelParameters keeps its .model
        clipped = [p for group in optimizer.param_groups for p in group["params"]]

        def clip_once(*_) -> None:
            nn.utils.clip_grad_norm_(clipped, max_norm)

        step_hooks(optimizer, before=clip_once)
        return optimizer

    return build


# --- GradScaler --------------------------------------------------------------------------------------

def scaled(objective: Objective, model: nn.Module) -> Objective:
    """``objective`` with an enabled GradScaler: the precision's own, else a fresh one on the model's device.

    A fresh scaler starts at its initial scale (2**16) and grows only after 2000 clean steps, so a
    short run sees one fixed power-of-two scale: exact in float32 and float64.
    """
    if objective.scaler.is_enabled():
        return objective
    with_scaler = copy.copy(objective)
    with_scaler.scaler = torch.amp.GradScaler(next(model.parameters()).device.type)
    return with_scaler


@dataclasses.dataclass(frozen=True)
class ScalerAccumulate(Chunked):
    name = "scaler_accumulate"
    anchorable = False  # the scaler's state between steps is not in an anchor
    summary = "GradScaler done right: scale(loss).backward() per micro-batch, unscale_ + step + update once"

    def train_step(self, model, optimizer, batch, objective):
        objective = scaled(objective, model)
        loss = backward_chunks(objective.forward_of(model), batch.inputs, batch.targets, self.chunks,
                               global_mean_part(objective, batch),
                               objective=objective)
        objective.scaler.unscale_(optimizer)  # where a loop would clip: once, on the whole sum
        finish_step(optimizer, objective)
        return loss


@dataclasses.dataclass(frozen=True)
class ScalerUnscalePerMicroBatch(Chunked):
    name = "scaler_unscale_per_micro_batch"
    anchorable = False  # the scaler's state between steps is not in an anchor
    summary = "PITFALL: GradScaler.unscale_ (+ update, to be allowed again) per micro-batch: earlier parts unscaled twice"
    pitfall = Pitfall("GradScaler unscale_ per micro-batch", twin="scaler_accumulate")

    def train_step(self, model, optimizer, batch, objective):
        objective = scaled(objective, model)

        def unscale_so_far():
            if any(p.grad is not None for p in model.parameters()):
                objective.scaler.unscale_(optimizer)  # the bug: unscales the partial sum so far...
                objective.scaler.update()  # ...and update() lets unscale_ run again on the next one

        unscaling = meddling_part(unscale_so_far, objective, batch)
        return accumulate(model, optimizer, batch, objective, self.chunks, unscaling)  # step() unscales once more


@dataclasses.dataclass(frozen=True)
class ScalerStepPerMicroBatch(StepPerMicroBatch):
    name = "scaler_step_per_micro_batch"
    anchorable = False  # the scaler's state between steps is not in an anchor
    summary = "PITFALL: GradScaler.step + update after every micro-batch: K small steps instead of one"
    pitfall = Pitfall("optimizer.step per micro-batch", twin="scaler_accumulate")

    def train_step(self, model, optimizer, batch, objective):
        return super().train_step(model, optimizer, batch, scaled(objective, model))


# --- dropout -----------------------------------------------------------------------------------------

DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


class MaskReplay:
    """Record the dropout masks a global-batch forward draws, then give each micro-batch its rows.

    Masks depend only on shapes and the RNG stream, so one forward of the global batch without a
    graph (the first pass of gradient-caching libraries) draws exactly what full-batch training
    draws. A micro-batch forward then multiplies by its rows of those masks (the batch on dim 0).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.dropouts = [m for m in model.modules() if isinstance(m, DROPOUTS)]
        self.masks: dict[nn.Module, list[Tensor]] = {m: [] for m in self.dropouts}

    @contextmanager
    def recording(self) -> Iterator[None]:
        real_inputs: dict[nn.Module, Tensor] = {}

        def ones_in(module, args):
            real_inputs[module] = args[0]
            return (torch.ones_like(args[0]),)  # dropout(ones) is the scaled mask itself

        def keep_mask(module, args, mask):
            self.masks[module].append(mask)
            return real_inputs.pop(module) * mask

        with _hooks(self.dropouts, ones_in, keep_mask):
            yield

    @contextmanager
    def replaying(self) -> Iterator[None]:
        state = {"start": 0, "next": 0, "calls": {}}

        def new_micro_batch(module, args):
            state["start"], state["next"] = state["next"], state["next"] + len(args[0])
            state["calls"] = {}

        def apply_rows(module, args, _drawn):
            x = args[0]
            call = state["calls"][module] = state["calls"].get(module, -1) + 1
            recorded = self.masks[module]
            rows = recorded[call][state["start"] : state["start"] + len(x)] if call < len(recorded) else None
            if rows is None or rows.shape != x.shape:
                raise InvalidArgument(
                    f"replayed_dropout: dropout input of shape {tuple(x.shape)} has no matching rows in the recorded "
                    "global-batch masks: expected every dropout input to hold the batch on dim 0"
                )
            return x * rows

        handle = self.model.register_forward_pre_hook(new_micro_batch)
        try:
            with _hooks(self.dropouts, None, apply_rows):
                yield
        finally:
            handle.remove()


@contextmanager
def _hooks(modules, pre, post) -> Iterator[None]:
    handles = [m.register_forward_pre_hook(pre) for m in modules if pre] + [m.register_forward_hook(post) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class ReplayedDropout(Chunked):
    name = "replayed_dropout"
    summary = "accumulate, each micro-batch applying its rows of the dropout masks the global batch draws"

    def train_step(self, model, optimizer, batch, objective):
        replay = MaskReplay(model)
        with torch.no_grad(), replay.recording():
            objective.forward(model, batch.inputs, batch.targets)
        device = batch.inputs.device
        # The micro-batch forwards' own draws are discarded: the stream goes on as after the full batch.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), replay.replaying():
            return accumulate(model, optimizer, batch, objective, self.chunks)


# --- recurrent models stepped token by token --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PerToken(Regime):
    """Seed 002: a decoder stepped one token at a time, with one backward per token's loss.

    The case's trunk must offer ``initial_hidden(inputs)`` and ``step(inputs[:, t], hidden)``, and its
    head maps a hidden state to the logits of one token.
    """

    detach: int = 0
    name = "per_token"
    summary = "one backward per token; detach=0 keeps the graph (full BPTT), detach=1 is seed 002's detach"
    # The family is seed 002's pitfall (detach=1); detach=0 is its faithful twin. Strategies never draw
    # it as a faithful regime: their cases have no trunk that steps one token.
    pitfall = Pitfall("hidden state detached between per-token backwards (truncated BPTT)", twin="per_token:detach=0")
    needs_split = True
    split_contract = "a function model -> (trunk, head) whose trunk steps one token (initial_hidden, step)"

    def __post_init__(self) -> None:
        if self.detach not in (0, 1) or isinstance(self.detach, bool):
            raise InvalidArgument.value("detach", self.detach, "0 (full BPTT) or 1 (hidden state detached per token)")

    def validate(self, case):
        """The trunk's contract too, read off the case's model built once (seeded, so no random state moves; not on
        the meta device, whose initialisers import torch's compiler, a second): a case whose trunk does not step one
        token cannot take this regime, which a matrix then skips there."""
        super().validate(case)
        try:
            with seeded(DEFAULT_SEED):
                trunk, _ = case.split(case.model())
        except Exception:  # a model that cannot be built here: training tells
            return
        self._expect_token_steps(trunk, case.name)

    def _expect_token_steps(self, trunk, case: str = "") -> None:
        on = f" on case {case!r}" if case else ""
        for method in ("initial_hidden", "step"):
            if not callable(getattr(trunk, method, None)):
                raise InvalidArgument(f"regime {str(self)!r}{on}: the case's trunk {type(trunk).__name__} has no "
                                      f"{method}(): expected initial_hidden(inputs) and step(inputs[:, t], hidden)")

    def train_step(self, model, optimizer, batch, objective):
        trunk, head = objective.split(model)
        self._expect_token_steps(trunk)  # a model the meta device could not build is checked here
        hidden, total = trunk.initial_hidden(batch.inputs), 0.0
        length = batch.inputs.shape[1]
        for t in range(length):
            hidden = trunk.step(batch.inputs[:, t], hidden)
            part = objective.sum(head(hidden)[:, None], batch.targets[:, t : t + 1]) / batch.items
            objective.backward(part, retain_graph=not self.detach and t < length - 1)
            if self.detach:
                hidden = hidden.detach()  # seed 002's "not sure why I need to detach here"
            total = total + part.detach()
        finish_step(optimizer, objective)
        return total


# --- samplers that make shards equal ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplerPad(Chunked):
    name = "sampler_pad"
    summary = "PITFALL: equal micro-batches made by repeating the first samples (DistributedSampler's padding)"
    pitfall = Pitfall("sampler pads micro-batches by repeating samples", twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        size = math.ceil(len(batch) / self.chunks)
        index = torch.arange(size * self.chunks, device=batch.inputs.device) % len(batch)
        return accumulate(model, optimizer, Batch(batch.inputs[index], batch.targets[index], batch.count),
                          objective, self.chunks)


@dataclasses.dataclass(frozen=True)
class SamplerDrop(Chunked):
    name = "sampler_drop"
    summary = "PITFALL: equal micro-batches made by dropping the remainder (drop_last=True)"
    pitfall = Pitfall("sampler drops the remainder (drop_last)", twin="accumulate")

    def train_step(self, model, optimizer, batch, objective):
        kept = len(batch) // self.chunks * self.chunks
        if kept == 0:  # an epoch's last batch smaller than the micro-batch count: dropped whole, never stepped
            return None
        # Faithful accumulation of whatever batch the sampler produced: the bug is in the data, not the sum.
        return accumulate(model, optimizer, Batch(batch.inputs[:kept], batch.targets[:kept], batch.count),
                          objective, self.chunks)
