"""A case: what is trained (model, data, loss, optimizer, steps), independent of how.

The regimes decide *how* one optimizer step is computed; a case only says what the step is for.
Its loss returns one loss per item (``reduction='none'``), leaving out the items that don't count
(padding), so the harness can normalise every regime by the item count of the whole global batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cached_property

import torch
from torch import Tensor, nn

from .errors import InvalidArgument, expect_callable, expect_int, expect_number, expect_tolerances
from .precision import NAMES_OF_DTYPES, Precision, resolve_precision

ModelFactory = Callable[[], nn.Module]
DataFactory = Callable[[], "tuple[Tensor, Tensor]"]
LossFn = Callable[[Tensor, Tensor], Tensor]
Split = Callable[[nn.Module], "tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]"]

def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum: unlike Adam, it does not normalise away a gradient scale bug."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def count_samples(targets: Tensor) -> int:
    """The default item count: one loss item per sample."""
    return len(targets)


@dataclasses.dataclass(frozen=True)
class ItemsPerSample:
    """The count of a case that declares no ``items=`` and whose loss returns one loss per target element
    (a per-token loss): ``per_sample`` items in every sample, as read off the loss (see :func:`counted_by_its_loss`)."""

    per_sample: int

    def __call__(self, targets: Tensor) -> int:
        return self.per_sample * len(targets)


@dataclasses.dataclass(frozen=True)
class Term:
    """One more term of a case's objective, normalised over a unit of its own (the main loss is normalised over the
    items): ``loss(output, targets)`` returns one value per unit of the batch (a sequence-wise load-balancing loss:
    one per sample; a router z-loss: one per token), ``units(targets)`` counts the units (default: one per sample),
    and the objective adds ``weight`` times the term's mean over the global batch's units. Every regime adds each
    micro-batch's sum over the global count, so a term that is a mean of per-unit values is honoured by them all; a
    term that is not (a batch-wise aux loss, whose expert counts a micro-batch cannot see) is declared non-equivalent
    under the regimes that cut the batch, in the case's ``expect_mismatch``."""

    name: str
    loss: LossFn
    units: Callable[[Tensor], int] = count_samples
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise InvalidArgument.value("name", self.name, "a term's name: an identifier such as 'load_balance'")
        expect_callable("loss", self.loss)
        expect_callable("units", self.units)
        expect_number("weight", self.weight, minimum=-math.inf, maximum=math.inf, strict=True)


LOSS_REDUCTIONS = ("none", "mean")
LAST_BATCH = ("exact", "keep")  # exact: data holds steps * batch_size samples; keep: the last batch may be smaller


@dataclasses.dataclass(frozen=True)
class Case:
    """A small deterministic training problem that every regime must solve identically.

    ``model`` and ``data`` are factories, called after the harness seeds the RNG, so every regime
    starts from the same weights and data. ``data`` holds exactly ``steps * batch_size`` samples
    (with ``last_batch='keep'``, from ``(steps - 1) * batch_size + 1`` to that).
    ``items`` counts the loss items in a batch of targets (default: one per sample; a token model
    counts its real tokens). ``split`` maps a model to ``(trunk, head)`` for ``detached_partial``.
    ``expect_mismatch`` maps a regime name (``accumulate``) or exact spec (``accumulate:chunks=5``)
    to the reason it must *not* match: a case that demonstrates a pitfall.
    ``regimes`` lists the specs this case is checked under by default (``None``: the defaults).
    ``loss_reduction='mean'``: ``loss`` returns the mean over the batch's items instead of one loss per
    item (a model's own loss). ``max_norm``: the clipping threshold the code checked uses (see audit.py); a team's
    step is held to full batch clipped there. ``clip_scale=S``: every ``clip_grad_norm_`` of every run clips at S
    times its threshold (runners/clipping.py), so that clipping engages in the team's code and the reference alike.
    ``cpu_generator_only``: why the case's verdicts rest on the CPU generator's draw order (where it is
    non-empty, a precision mode that trains on CUDA skips the case with that reason instead of judging it).
    ``tp_plan``: how tensor-parallel regimes shard the model, module names (``fnmatch`` patterns allowed) to
    ``'colwise'``, ``'rowwise'`` or ``'sequence'``; plain data, so it crosses to ranks (None: derived where the model
    has the common shape, see :mod:`equivcheck.regimes.tensor`).
    """

    name: str
    model: ModelFactory
    data: DataFactory
    loss: LossFn
    batch_size: int
    steps: int = 1
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    split: Split | None = None
    items: Callable[[Tensor], int] = count_samples
    expect_mismatch: Mapping[str, str] = dataclasses.field(default_factory=dict)
    regimes: tuple[str, ...] | None = None
    dtype: torch.dtype = torch.float64
    rtol: float | None = None
    atol: float | None = None
    description: str = ""
    max_norm: float | None = None  # the clip_grad_norm_ threshold the team's code uses: the audit tells if it engages
    loss_reduction: str = "none"  # "mean": loss returns the mean over the batch's items (a Hugging Face model's .loss)
    forward: Callable[[nn.Module, Tensor, Tensor], object] | None = None  # how to call the model: default model(inputs)
    last_batch: str = "exact"  # "keep": the last global batch of an epoch may hold fewer than batch_size samples
    epochs: int = 1  # passes over the data, each in the same order: steps * epochs optimizer steps in all
    cpu_generator_only: str = ""  # why the verdicts hold on the CPU generator only (CUDA draws by launch shape)
    tp_plan: Mapping[str, str] | None = None  # module name or pattern -> 'colwise', 'rowwise' or 'sequence'
    # the learning-rate schedule over the optimizer a regime steps: scheduler(optimizer) -> an LRScheduler
    scheduler: Callable[[torch.optim.Optimizer], object] | None = None
    terms: tuple[Term, ...] = ()  # more terms of the objective, each normalised over its own unit (Term)
    # Every clip_grad_norm_ of every run clips at this times the threshold its caller gave (the team's code and the
    # reference's max_norm alike): clipping engages where the case's gradients stay under a threshold the check cannot
    # otherwise lower (a module constant in the team's step)
    clip_scale: float | None = None

    def clipping_threshold(self, max_norm: float) -> float:
        """Where a ``clip_grad_norm_`` at ``max_norm`` clips in this case's runs: scaled by ``clip_scale``."""
        return max_norm * (self.clip_scale or 1.0)

    def __post_init__(self) -> None:
        if (not isinstance(self.name, str) or not self.name.strip() or any(c in self.name for c in " ,:=")
                or not self.name.isprintable()):  # a control character would redraw the tables the name stands in
            raise InvalidArgument.value("name", self.name,
                                        "a non-empty string of printable characters without spaces, ',', ':' or '='")
        for argument in ("model", "data", "loss", "optimizer", "items"):
            expect_callable(argument, getattr(self, argument))
        if isinstance(self.model, nn.Module):
            raise InvalidArgument(
                f"model={self.model!r} is not allowed: expected a factory that builds the model, such as "
                f"model=lambda: {type(self.model).__name__}(...): every regime trains a fresh model from the same seed"
            )
        if self.split is not None:
            expect_callable("split", self.split)
        if self.forward is not None:
            expect_callable("forward", self.forward)
        if self.scheduler is not None:
            expect_callable("scheduler", self.scheduler)
        object.__setattr__(self, "terms", tuple(self.terms) if isinstance(self.terms, (list, tuple)) else self.terms)
        if not isinstance(self.terms, tuple) or not all(isinstance(term, Term) for term in self.terms):
            raise InvalidArgument.value("terms", self.terms, "a tuple of ec.Term (more terms of the objective)")
        if len({term.name for term in self.terms}) != len(self.terms):
            raise InvalidArgument.value("terms", self.terms, "terms of distinct names")
        expect_int("batch_size", self.batch_size)
        expect_int("steps", self.steps)
        if self.dtype not in NAMES_OF_DTYPES:
            raise InvalidArgument.value("dtype", self.dtype, "torch.float64 or torch.float32")
        expect_tolerances(self.rtol, self.atol)
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise InvalidArgument.value("loss_reduction", self.loss_reduction, " or ".join(map(repr, LOSS_REDUCTIONS)))
        if self.last_batch not in LAST_BATCH:
            raise InvalidArgument.value("last_batch", self.last_batch, " or ".join(map(repr, LAST_BATCH)))
        expect_int("epochs", self.epochs)
        if not isinstance(self.cpu_generator_only, str):
            raise InvalidArgument.type("cpu_generator_only", self.cpu_generator_only, "a string (the reason), or ''")
        if self.max_norm is not None:
            expect_number("max_norm", self.max_norm, minimum=0, maximum=math.inf, strict=True)
        if self.clip_scale is not None:
            expect_number("clip_scale", self.clip_scale, minimum=0, maximum=math.inf, strict=True)
        if not isinstance(self.expect_mismatch, Mapping):
            raise InvalidArgument.type("expect_mismatch", self.expect_mismatch, "a mapping of regime -> reason")
        if self.regimes is not None:
            object.__setattr__(self, "regimes", tuple(self.regimes))
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping) or not all(
                    isinstance(name, str) and style in TP_STYLES for name, style in self.tp_plan.items()):
                raise InvalidArgument.value("tp_plan", self.tp_plan, "a mapping of module names (or patterns) to "
                                            + ", ".join(map(repr, TP_STYLES)))
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))
        object.__setattr__(self, "built_at", _where_built())  # not a field: an error naming a case bound nowhere reads it

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The case's optimizer over ``model``'s parameters; a factory that returns no optimizer is told so here,
        not by an AttributeError deep in a regime's step."""
        optimizer = self.optimizer(ModelParameters(model))
        if not all(callable(getattr(optimizer, method, None)) for method in ("step", "zero_grad")):
            raise InvalidArgument(
                f"optimizer={self.optimizer!r} of case {self.name!r} returned {optimizer!r} "
                f"(type={type(optimizer).__name__}): expected an optimizer with step() and zero_grad(), such as a "
                "torch.optim.Optimizer over the parameters it is given (does the factory return it?)")
        return optimizer

    def skeleton(self) -> nn.Module | None:
        """The model as its factory builds it, on the meta device: its modules and parameter shapes, with no weight
        drawn and no memory held (a 124M transformer builds there in 0.01 s, for real in 0.9 s, which a GPU check's
        host would pay beside steps of 30 ms); None where the factory cannot build there (it reads files, or a value
        it drew). Call it under the dtype and seed its runs build with."""
        try:
            with torch.device("meta"):
                return self.model()
        except Exception:  # noqa: BLE001 (whatever a factory raises off its device: the caller builds for real)
            return None

    def build_scheduler(self, optimizer: torch.optim.Optimizer):
        """The case's scheduler over ``optimizer``, or None where it has none; the run steps it after every step the
        optimizer takes in training (runners/train.py)."""
        if self.scheduler is None:
            return None
        scheduler = self.scheduler(optimizer)
        if not all(callable(getattr(scheduler, method, None)) for method in ("step", "state_dict", "load_state_dict")):
            raise InvalidArgument(
                f"scheduler={self.scheduler!r} of case {self.name!r} returned {scheduler!r} "
                f"(type={type(scheduler).__name__}): expected a learning-rate scheduler with step(), state_dict() and "
                "load_state_dict(), such as a torch.optim.lr_scheduler.LinearLR over the optimizer it is given")
        return scheduler

    @property
    def samples(self) -> int:
        return self.steps * self.batch_size


@dataclasses.dataclass(frozen=True)
class Batch:
    """One global batch: the data of one optimizer step, and how to count its loss items."""

    inputs: Tensor
    targets: Tensor
    count: Callable[[Tensor], int] = dataclasses.field(repr=False)

    @cached_property
    def items(self) -> int:
        """Loss items in this batch: the normaliser of a mean over the batch."""
        return int(self.count(self.targets))

    def __len__(self) -> int:
        return len(self.targets)


# A tp_plan's styles: torch's ParallelStyle of each, by name; "colwise_local" is colwise with the rank's local shard
# as its output (attention's projections: heads local per rank), "colwise" keeps a DTensor.
TP_STYLES = ("colwise", "colwise_local", "rowwise", "sequence")


class Objective:
    """What a regime may use of a case: its loss, checked to return one loss per item, and its split.

    Under a precision mode it also carries the mode's loss autocast and its GradScaler (``scaler``,
    disabled unless the mode uses one): regimes back-propagate through :meth:`backward` and step
    through :meth:`step`, the AMP recipe, which is plain ``backward()`` and ``step()`` when disabled.
    """

    def __init__(self, case: Case, precision: Precision | None = None, device: torch.device | str = "cpu") -> None:
        self._case = case
        self.precision = resolve_precision(precision, default=case.dtype)
        self.scaler = self.precision.grad_scaler_for(device)
        self._loss = self.precision.autocasting(case.loss, device)
        self._terms = [(term, self.precision.autocasting(term.loss, device)) for term in case.terms]
        self.loss_dtypes: set[torch.dtype] = set()  # what the loss was computed in: a float64 case may not be

    @property
    def case(self) -> Case:
        return self._case

    def forward(self, model: Callable, inputs: Tensor, targets: Tensor) -> object:
        """The model's output for the loss: ``model(inputs)``, or the case's ``forward(model, inputs, targets)``
        for a model that takes its targets too (one that computes its own loss, as nanoGPT's GPT does)."""
        return model(inputs) if self._case.forward is None else self._case.forward(model, inputs, targets)

    def forward_of(self, model: Callable) -> Callable[[Tensor, Tensor], object]:
        """``model`` as the micro-batch loop calls it: on a micro-batch's inputs and targets."""
        return lambda inputs, targets: self.forward(model, inputs, targets)

    def _call_loss(self, output: object, targets: Tensor) -> object:
        """The case's loss on ``output``; a model whose output is not a tensor is named when the loss breaks on it."""
        try:
            loss = self._loss(output, targets)
        except (AttributeError, TypeError, IndexError) as error:
            if isinstance(output, Tensor):
                raise
            raise InvalidArgument(
                f"the model of case {self._case.name!r} returned {_described(output)}, and its loss raised "
                f"{type(error).__name__}: {error}. The loss receives the model's output as it is: read the logits "
                "there (loss=lambda output, targets: F.cross_entropy(output[0], targets, reduction='none') for a "
                "(logits, loss) tuple, output.logits for a Hugging Face ModelOutput)"
            ) from error
        if isinstance(loss, Tensor):
            self.loss_dtypes.add(loss.dtype)
        return loss

    @property
    def epochs(self) -> int:
        """How many passes over the data the batches a regime trains on make (a team's loop is told)."""
        return self._case.epochs

    def backward(self, loss: Tensor, *, retain_graph: bool = False) -> None:
        self.scaler.scale(loss).backward(retain_graph=retain_graph)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step (unscaled and skipped on overflow by the scaler, when enabled)."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def item_losses(self, output: Tensor, targets: Tensor) -> Tensor:
        """The batch's losses as one 1-D tensor: one per item, or one per element of a loss that keeps the positions
        ``items=`` leaves out as zeros (torch's ``reduction='none'`` with ``ignore_index``), which add nothing to a
        sum; such a loss cut per sample is cut by its own shape, as the batch is."""
        losses = self._call_loss(output, targets)
        expected = int(self._case.items(targets))
        if isinstance(losses, Tensor) and losses.dim() > 1 and losses.numel() == expected:
            losses = losses.reshape(-1)  # a per-token loss of shape (samples, tokens): one item per element
        if self._keeps_ignored(losses, targets, expected):
            return self._ignored_are_zeros(losses, targets, expected).reshape(-1)
        if not isinstance(losses, Tensor) or losses.dim() != 1 or len(losses) != expected:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            scalar = isinstance(losses, Tensor) and losses.dim() == 0
            raise InvalidArgument(
                f"loss of case {self._case.name!r} returned shape {shape} for {len(targets)} samples holding "
                f"{expected} items: expected a 1-D tensor of one loss per item (reduction='none'), "
                "leaving out only the items that don't count, or one loss per target element, 0 where items= does "
                "not count it (ignore_index), or without items= one loss per target element "
                "(a per-token loss of shape (samples, tokens))"
                + (". If it is the mean over those items (a Hugging Face model's .loss), declare "
                   "Case(loss_reduction='mean')" if scalar else "")
            )
        return losses

    def _keeps_ignored(self, losses: object, targets: Tensor, expected: int) -> bool:
        """Whether ``losses`` is one loss per position of every sample, more of them than the items that count:
        ``(samples * tokens,)`` or ``(samples, tokens)``, the ignored positions kept."""
        samples = len(targets)
        return (isinstance(losses, Tensor) and self._case.items is not count_samples and samples > 0
                and losses.numel() > expected and losses.numel() % samples == 0
                and (losses.dim() == 1 or losses.shape[0] == samples))

    def _ignored_are_zeros(self, losses: Tensor, targets: Tensor, expected: int) -> Tensor:
        """``losses``, where at least as many of them are 0 as ``items=`` leaves out: else refused, naming the
        positions that items= leaves out and the loss does not (where items= can count one target alone)."""
        left_out = losses.numel() - expected
        zeros = int((losses.detach() == 0).sum())
        if zeros >= left_out:
            return losses
        named = _nonzero_left_out(self._case.items, losses.detach(), targets)
        raise InvalidArgument(
            f"loss of case {self._case.name!r} returned shape {tuple(losses.shape)} for {len(targets)} samples holding "
            f"{expected} items: the {left_out} positions items= leaves out must hold a loss of 0 (as torch's "
            f"ignore_index gives), and only {zeros} do"
            + (f"; not 0 where items= counts nothing: {named}" if named else "")
            + ". Return 0 there (F.cross_entropy(..., reduction='none', ignore_index=-100)), or leave them out"
        )

    def counted_by_its_loss(self, model: nn.Module, batch: Batch) -> Case:
        """The case, counting one item per element of its loss where it declares no ``items=``, holds more
        than one target value per sample, and its loss returns a multiple of one value per sample (a
        per-token loss). Read off one forward of ``batch`` in eval mode without a graph, every generator
        restored: no random draw of the run changes. A loss with elements exactly 0 (ignored padding)
        must say how many items count, so it stays an error there."""
        case = self._case
        if case.items is not count_samples or case.loss_reduction != "none" or batch.targets.dim() < 2:
            return case
        was_training = model.training
        device = next(model.parameters()).device
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.eval()
            try:
                losses = self._call_loss(self.forward(model, batch.inputs, batch.targets), batch.targets)
            finally:
                model.train(was_training)
        samples = len(batch)
        if not isinstance(losses, Tensor) or losses.numel() <= samples or losses.numel() % samples:
            return case  # not one loss per target element: item_losses says what it expects
        zeros = int((losses == 0).sum())
        if zeros:
            raise InvalidArgument(
                f"loss of case {case.name!r} returned {losses.numel()} losses for {samples} samples, {zeros} of them "
                "exactly 0, as ignored padding gives: declare items= counting the items that count (e.g. "
                "items=lambda targets: int((targets != -100).sum()))"
            )
        return dataclasses.replace(case, items=ItemsPerSample(losses.numel() // samples))

    def _mean_loss(self, output: Tensor, targets: Tensor) -> tuple[Tensor, int]:
        """A ``loss_reduction='mean'`` case's loss: the mean over the batch's items, and their count."""
        loss, count = self._call_loss(output, targets), int(self._case.items(targets))
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise InvalidArgument(f"loss of case {self._case.name!r} returned shape {shape}: with "
                                  "loss_reduction='mean' it must return one scalar, the mean over the batch's items")
        if count == 0:
            raise InvalidArgument(f"case {self._case.name!r}: a (micro-)batch holds 0 items, and a mean over none is "
                                  "undefined: use loss_reduction='none' (one loss per item) for such batches")
        return loss, count

    def sum(self, output: Tensor, targets: Tensor) -> Tensor:
        if self._case.loss_reduction == "mean":  # a mean over a known item count is a sum divided by that count
            loss, count = self._mean_loss(output, targets)
            return loss * count
        return self.item_losses(output, targets).sum()

    def share(self, output: object, targets: Tensor, over: Batch, *, terms_scale: float = 1.0) -> Tensor:
        """This (micro-)batch's part of the objective of the global batch ``over``: the loss's sum over ``over``'s
        items, plus each of the case's terms' sum over ``over``'s count of its units, weighted (and times
        ``terms_scale``: a pitfall's). The parts of every cut of ``over`` add up to its objective, whatever the cut."""
        part = self.sum(output, targets) / over.items
        for term, values in self._term_values(output, targets):
            part = part + terms_scale * term.weight * values.sum() / int(term.units(over.targets))
        return part

    def mean(self, output: Tensor, targets: Tensor) -> Tensor:
        """The objective of this (micro-)batch on its own: the loss's mean over its items and each term's over its
        units (what a pitfall that normalises each part by itself takes)."""
        if self._case.loss_reduction == "mean":
            mean = self._mean_loss(output, targets)[0]
        else:
            losses, count = self.item_losses(output, targets), int(self._case.items(targets))
            mean = losses.mean() if len(losses) == count else losses.sum() / count  # ignored zeros are no items
        return mean + self.terms_mean(output, targets)

    def terms_mean(self, output: object, targets: Tensor) -> Tensor | float:
        """The case's terms on this (micro-)batch on its own: each one's mean over its units here, weighted (0.0
        without terms)."""
        return sum((term.weight * values.mean() for term, values in self._term_values(output, targets)), 0.0)

    def _term_values(self, output: object, targets: Tensor) -> Iterator[tuple[Term, Tensor]]:
        """Each of the case's terms with its values on this batch, checked to be one per unit."""
        for term, loss in self._terms:
            values, units = loss(output, targets), int(term.units(targets))
            if not isinstance(values, Tensor) or values.dim() != 1 or len(values) != units:
                shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
                raise InvalidArgument(
                    f"term {term.name!r} of case {self._case.name!r} returned shape {shape} for {len(targets)} samples "
                    f"holding {units} of its units: expected a 1-D tensor of one value per unit (units= counts them; "
                    "default: one per sample)")
            yield term, values

    def split(self, model: nn.Module) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
        """The case's ``(trunk, head)`` of ``model``; regimes that need it validate its presence first."""
        assert self._case.split is not None
        return self._case.split(model)


def _nonzero_left_out(items: Callable[[Tensor], int], losses: Tensor, targets: Tensor, most: int = 5) -> str:
    """The first ``most`` positions (sample, position) whose target ``items`` counts as no item but whose loss is not
    0, with their losses; '' where there is not one loss per target element or ``items`` cannot count one alone."""
    if losses.numel() != targets.numel():
        return ""
    flat, per_sample = targets.reshape(-1), max(1, targets[0].numel())
    alone = [1] * targets.dim()
    found = []
    try:
        for index, loss in enumerate(losses.reshape(-1).tolist()):
            if loss != 0 and int(items(flat[index : index + 1].reshape(alone))) == 0:
                found.append(f"(sample {index // per_sample}, position {index % per_sample}) {loss:.3g}")
                if len(found) == most:
                    break
    except Exception:  # noqa: BLE001 (an items= that cannot count one target alone: the counts say enough)
        return ""
    return ", ".join(found)


def _where_built() -> tuple[str, int, str] | None:
    """(file, line, function) of the code that built a case: the first frame past dataclasses' generated ``__init__``,
    ``dataclasses.replace`` and equivcheck's own modules."""
    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(("<", ours))
                                 or frame.f_code.co_filename == dataclasses.__file__):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def _described(output: object) -> str:
    """What a model returned, briefly: ``a tuple of (Tensor (12, 3), NoneType)``."""
    def one(item: object) -> str:
        return f"Tensor {tuple(item.shape)}" if isinstance(item, Tensor) else type(item).__name__
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of ({', '.join(one(item) for item in output)})"
    return f"a {type(output).__name__}, not a tensor"


class ModelParameters(list):
    """The model's parameters, as an optimizer factory receives them, with the model itself as ``.model``:
    a factory that groups parameters by module (nanoGPT's ``configure_optimizers``) reads it there."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model.parameters())
        self.model = model
