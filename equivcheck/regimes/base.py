"""The regime interface, spec parsing and the registry.

A regime is a way of computing one optimizer step on one global batch: a frozen dataclass parsed
from a short spec (``accumulate:chunks=4``). Its ``train_step`` performs exactly one optimizer step
the way a training loop would and returns the batch loss. Faithful regimes normalise by the item
count of the *global* batch, so they reproduce ``full_batch`` up to rounding; pitfall regimes
reproduce a known bug, and equivcheck must report them as mismatches. A pitfall regime declares what
it is once, on its class (``pitfall = Pitfall(bug, twin)``): the class of bug, as the audit names it,
and its faithful twin, which the audit, the catalogue and its cases hold it against.

Everything the rest of the harness needs to know about a regime is asked here, never probed:
where it runs (``world_size``, ``distributed``, ``device``), how it cuts the batch
(``micro_batches``), what it needs of a case (``needs_split``), how it wraps the model and builds
the optimizer, how it counts communication and reads full tensors back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..case import Batch, Case, Objective
from ..device import DEFAULT_DEVICE, RankPlacement
from ..errors import InvalidArgument, expect_int, expect_number
from ..precision import Precision, Tolerance


# The options that compile a regime (regimes/compiled.py): a compiled pitfall's twin is compiled alike.
COMPILE_OPTIONS = ("compile", "compiled_autograd", "compile_optimizer")


@dataclasses.dataclass(frozen=True)
class Pitfall:
    """What a pitfall regime is: the class of bug it reproduces and the faithful twin it must be held against.

    ``bug``: the class, as :mod:`equivcheck.suites.audit` names it (one of its ``BUG_CLASSES``); a tuple where the
    bug shows as more than one (a micro-batch mean / K: uneven micro-batches, and uneven token counts).
    ``twin``: the spec of the regime doing the same job right, with only what differs from the pitfall; every
    parameter the two share is the pitfall's own (``naive_accumulate:chunks=4`` -> ``accumulate:chunks=4``,
    ``ddp_mean_loss:world_size=2,backend=gloo`` -> ``ddp:world_size=2,backend=gloo``). A family whose faithful
    member is one of its own settings names it (``per_token:detach=0``): that member is its own twin.
    """

    bug: str | tuple[str, ...]
    twin: str

    @property
    def bugs(self) -> tuple[str, ...]:
        return (self.bug,) if isinstance(self.bug, str) else tuple(self.bug)

    def twin_of(self, regime: Regime | str) -> Regime:
        """The faithful twin of ``regime`` (a spec or an instance of the class declaring this)."""
        regime = parse_regime(regime)
        name, _, given = self.twin.partition(":")
        stated = [item.strip() for item in given.split(",") if item.strip()]
        named = {item.partition("=")[0].strip() for item in stated}
        own = {f.name for f in spec_fields(regime)}
        if name not in REGIMES:
            raise InvalidArgument.unknown("regime", name, REGIMES)
        shared = [f"{f.name}={_spec_value(getattr(regime, f.name))}" for f in spec_fields(REGIMES[name])
                  if f.name in own and f.name not in named]
        compiled = [f"{option}={_spec_value(getattr(regime, option))}" for option in COMPILE_OPTIONS
                    if getattr(regime, option, None) and option not in named]
        params = ",".join(stated + shared + compiled)  # a compiled pitfall's twin is compiled alike
        twin = parse_regime(f"{name}:{params}" if params else name)
        return twin.joined(*regime.joins) if regime.joins else twin  # a resume's twin joins the same regimes


@dataclasses.dataclass(frozen=True)
class Regime:
    name: ClassVar[str]
    summary: ClassVar[str]
    # A pitfall regime's declaration (see Pitfall); None: a faithful regime. Read as a truth value, it says
    # whether the regime is a pitfall (a regime of your own may still say ``pitfall = True``, without a twin).
    pitfall: ClassVar[Pitfall | bool | None] = None
    # Where PyTorch itself refuses the regime in general (it crashes), why: kept to show the crash, and
    # never drawn by equivcheck.strategies as a regime that must stay equivalent.
    trap: ClassVar[str] = ""
    distributed: ClassVar[bool] = False  # runs on every rank of a process group (see equivcheck.runners.ranks)
    world_size: ClassVar[int] = 1  # ranks a step runs on; a distributed regime's own field overrides it
    syncs_per_step: ClassVar[int | None] = None  # gradient all-reduce rounds a faithful step makes per wrapper
    sync_collective: ClassVar[str] = "all-reduced"  # what a sync does to the gradients, as reports say it
    # Sets every gradient to None after each optimizer step (finish_step) and writes to none after it: a recording
    # may keep the very tensors each step used instead of copies (training.py checks that nothing wrote to them).
    releases_gradients: ClassVar[bool] = False
    needs_split: ClassVar[bool] = False  # trains the case's trunk and head apart: the case must give split=
    # Needs what only some cases have (a tensor-parallel plan, a sequence to cut): drawn by the strategies only when named
    fits_some_cases: ClassVar[bool] = False
    # The harness may tell which global batch each optimizer step belongs to: batches are taken one at a time.
    # A whole loop may take them all at once (to build a DataLoader), and then nobody can tell.
    steps_observable: ClassVar[bool] = True
    # A team's step is one call per global batch: its communication counts per call, whatever it does after its
    # optimizer.step() (all-reducing a logged loss) included; a regime of equivcheck's counts per optimizer step.
    counts_per_call: ClassVar[bool] = False
    split_contract: ClassVar[str] = "a function model -> (trunk, head) with head(trunk(x)) == model(x)"
    between: ClassVar[bool] = False  # written between the regimes it joins, with '>' (a resume: :meth:`joined`)
    # Steps through the objective's GradScaler, whose state (scale, growth tracker) is then part of what the run
    # produced; a team's own code keeps a scaler of its own, which the harness does not see.
    harness_scaler: ClassVar[bool] = True
    # Its steps may start from the reference's own state (runners/anchors.py): it trains in this process on the
    # case's optimizer, through the model's own forward, with no checkpoint or scaler state between its steps.
    anchorable: ClassVar[bool] = False

    @property
    def joins(self) -> tuple[Regime, Regime | None] | None:
        """The regimes this one joins, written around it with '>' (a resume: ``BEFORE>resume:at=K>AFTER``), else
        None."""
        return None

    def joined(self, before: Regime, after: Regime | None) -> Regime:
        """This regime joining ``before`` to ``after``: only a regime whose spec is written between two takes them."""
        raise InvalidArgument(f"regime spec {str(self)!r}: '>' joins regimes around a resume only "
                              "('BEFORE>resume:at=K>AFTER'), and this regime joins none")

    def __str__(self) -> str:
        """The canonical spec: parameters in declaration order, those left at their default omitted, and those derived
        from others (``fsdp_tp``'s world size, ``dp * tp``) too."""
        params = ",".join(f"{f.name}={_spec_value(getattr(self, f.name))}" for f in spec_fields(self)
                          if getattr(self, f.name) != f.default and not f.metadata.get("derived"))
        return f"{self.name}:{params}" if params else self.name

    def validate(self, case: Case) -> None:
        """Raise :class:`InvalidArgument` if this regime cannot run ``case``."""
        if self.needs_split and case.split is None:
            raise InvalidArgument(f"regime {str(self)!r} on case {case.name!r}: split=None is not allowed: "
                                  f"expected {self.split_contract}")

    def micro_batches(self, case: Case) -> int:
        """How many pieces one rank cuts its batch into per step: above 1, the regime accumulates
        gradients, presumably to save memory (which the harness then measures)."""
        return 1

    def unavailable(self, device: str = DEFAULT_DEVICE) -> str | None:
        """Why this machine cannot run the regime for a check on ``device`` (missing GPUs), or None: the check is
        skipped, not faked."""
        return None

    def unavailable_in(self, precision: Precision, device: str = DEFAULT_DEVICE) -> str | None:
        """Why this machine cannot run the regime in ``precision`` on ``device``, or None."""
        return None

    def placement(self, device: str) -> RankPlacement | None:
        """Where the ranks of a distributed regime train for a check on ``device`` (equivcheck.device's rule); None:
        this process trains the run."""
        return None

    def device(self, asked: str = DEFAULT_DEVICE) -> torch.device:
        """Where this process trains for a check on ``asked``: that device, a rank's own under nccl (every rank
        regime), or DataParallel's first GPU."""
        return torch.device(asked)

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        """The module ``train_step`` drives: the model itself, or a DDP / DataParallel wrapper around it
        (or around each part of the case's ``split``, which ``objective`` gives)."""
        return model

    def build_optimizer(self, case: Case, model: nn.Module) -> Optimizer:
        """The optimizer this regime steps (a sharded optimizer would wrap the case's own here)."""
        return case.build_optimizer(model)

    def local_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer whose state this rank holds: ``optimizer`` itself, or a sharded one's own part."""
        return optimizer

    def count_communication(self, module: nn.Module) -> CommunicationCounter | None:
        """A counter of the gradient synchronisations ``module`` (every wrapper inside it) makes per step, or
        None: nothing to count."""
        return None

    def tolerance_for(self, case: Case, precision: Precision, base: Tolerance) -> Tolerance | None:
        """The tolerance a lossy regime (a compressing comm hook) is compared at in ``precision``: ``base`` (the
        case's or the mode's) widened by its own error bound, with ``source`` naming it; None: ``base``
        itself. A tolerance the call gives (``rtol=``, ``atol=``) overrides this."""
        return None

    def declared_collectives(self) -> dict[str, int] | None:
        """What a faithful step communicates, by kind (``"all_reduce[tp]"``) and calls, where the spec declares it
        (``collectives=``): any other count is a ``communication`` verdict. None: not declared, not judged."""
        return None

    def clips_at(self) -> float | None:
        """The gradient norm this regime clips to before each step (a clipped reference), or None."""
        return None

    def full_tensor(self, tensor: Tensor, name: str = "") -> Tensor:
        """``tensor`` (parameter or buffer ``name``, or its gradient) whole, as full-batch training holds it (a sharded
        wrapper gathers its shards here)."""
        return tensor

    def read_back(self, named: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's parameters (or their gradients) by name, each whole (:meth:`full_tensor`), under the names the
        case's model gives them: what is compared with the reference's."""
        return {name: self.full_tensor(tensor, name) for name, tensor in named.items()}

    def random_streams(self, model: nn.Module, optimizer: Optimizer, inputs: Sequence[Tensor]) -> AbstractContextManager:
        """The context training runs in, as far as the random draws of the model's forwards go: as they come in one
        process; on ranks, dropout drawing the global batch's masks (each global batch's ``inputs``: see
        :mod:`equivcheck.regimes.aligned_dropout`)."""
        return contextlib.nullcontext()

    def train_step(self, model: nn.Module, optimizer: Optimizer, batch: Batch, objective: Objective) -> Tensor:
        raise NotImplementedError

    def train(
        self, model: nn.Module, optimizer: Optimizer, batches: Sequence[Batch], objective: Objective
    ) -> Sequence[Tensor | float | None]:
        """Train on every global batch in turn; the batch losses (None: not reported). A whole-loop
        regime (a team's own training loop) overrides this instead of ``train_step``."""
        return [self.train_step(model, optimizer, batch, objective) for batch in batches]


COLLECTIVE_KIND = re.compile(r"[a-z_]+(\[[A-Za-z0-9_]+\])?")


def parse_collectives(text: str) -> dict[str, int]:
    """A spec's ``collectives=all_reduce[tp]*1+all_gather[dp]*4``: each kind a faithful step makes, times its calls
    per step (a kind left out: none; ``none``: no collective at all). InvalidArgument naming what does not read."""
    declared: dict[str, int] = {}
    for part in filter(None, text.split("+") if text != "none" else ()):
        kind, times, calls = part.partition("*")
        if not (COLLECTIVE_KIND.fullmatch(kind) and times and calls.isdigit()) or kind in declared:
            raise InvalidArgument.value(
                "collectives", text, "kinds times their calls per step, each kind once, joined by '+' "
                "('all_reduce[tp]*1+all_gather[dp]*4'; a kind as a count names it: all_reduce, all_gather[dp])")
        declared[kind] = int(calls)
    return {kind: calls for kind, calls in declared.items() if calls}


def collectives_spec(declared: dict[str, int]) -> str:
    """``{"all_reduce[tp]": 1}`` as a spec writes it (``all_reduce[tp]*1``), kinds sorted; ``none`` for no collective."""
    return "+".join(f"{kind}*{calls}" for kind, calls in sorted(declared.items()) if calls) or "none"


@dataclasses.dataclass(frozen=True)
class DeclaresCollectives:
    """A regime whose spec may declare what a faithful step communicates (``collectives=all_reduce[tp]*1``): a step
    that makes another count of any kind, one declared or not, is a ``communication`` verdict."""

    collectives: str = dataclasses.field(default="", kw_only=True, metadata={"trailing": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_collectives(self.collectives)

    def declared_collectives(self) -> dict[str, int] | None:
        return parse_collectives(self.collectives) if self.collectives else None


# A class of bug several regimes declare (a loop's, a pipeline's, a mesh's): the loss divided by K again.
SCALED_TWICE = "loss scaled by 1 / K twice"

# Unit roundoff of each 16-bit type a gradient reduction may run in: half the distance from 1 to the next number.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# float16's smallest subnormal: a part smaller than half of it is lost in the cast (bfloat16 has float32's range).
SUBNORMAL = {"fp16": 2.0**-24, "bf16": 0.0}


def reduced_in(wire: str, world_size: int, precision: Precision, base: Tolerance, reduction: str) -> Tolerance:
    """``base`` widened by the error of a gradient averaged over ``world_size`` ranks in the 16-bit ``wire`` type
    (ddp_hooks.py says why): one rounding as each rank casts its part, one as it divides, W - 1 in the sum, each of
    the type's unit roundoff u, relative to the gradient and (where the parts cancel) absolute at parts of order one,
    plus float16's subnormal spacing per rank. ``reduction`` names what reduces so, for the tolerance's source."""
    u, roundings = UNIT_ROUNDOFF[wire], world_size + 1
    bound = roundings * u
    return base.widened(bound, bound + world_size * SUBNORMAL[wire], (
        f"{reduction}: {precision.name}'s tolerance plus the compression's bound, {roundings} roundings of "
        f"2^{int(math.log2(u))} each"))


def step_hooks(optimizer: Optimizer, before: Callable | None = None, after: Callable | None = None) -> list:
    """``before`` and ``after`` (torch's step-hook signature) around each outermost ``optimizer.step()``; the hooks'
    handles. torch runs an optimizer's step hooks once for every class on its way whose ``step`` it wrapped, and it
    wraps a class's ``step`` when an instance of it is made: once any AdamW was built in the process, a subclass whose
    ``step`` calls ``super().step()`` runs them twice a step. Only the outermost call is a step."""
    depth = [0]

    def pre(optimizer, args, kwargs):
        depth[0] += 1
        if depth[0] == 1 and before is not None:
            return before(optimizer, args, kwargs)
        return None

    def post(optimizer, args, kwargs) -> None:
        depth[0] -= 1
        if depth[0] == 0 and after is not None:
            after(optimizer, args, kwargs)

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def parameters_of(optimizer: Optimizer) -> list:
    """Every parameter ``optimizer`` steps, group after group."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def finish_step(optimizer: Optimizer, objective: Objective | None = None, max_norm: float = math.inf) -> None:
    """One optimizer step (through the objective's GradScaler if given), then clear the gradients; with a
    finite ``max_norm``, the whole gradient clipped to it first (unscaled first, as the AMP recipe says)."""
    if max_norm < math.inf:
        if objective is not None and objective.scaler.is_enabled():
            objective.scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(parameters_of(optimizer), max_norm)
    if objective is None:
        optimizer.step()
    else:
        objective.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def squared_norm(grads: list[Tensor], like: Tensor) -> Tensor:
    """The squares of ``grads`` summed, as ranks all-reduce them for a global norm: 0 in ``like``'s dtype and device
    where a rank holds none, so that every rank's tensor is of one type."""
    if not grads:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.nn.utils.get_total_norm(grads).to(like.dtype) ** 2


def scale_to(optimizer, max_norm: float, total_norm: Tensor) -> None:
    """Every gradient times ``max_norm / (total_norm + 1e-6)`` where that is below 1, as ``clip_grad_norm_`` scales."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in parameters_of(optimizer):
        if p.grad is not None:
            p.grad.mul_(coefficient.to(p.grad.dtype))


def micro_batch_count(samples: int, chunks: int) -> int:
    """How many micro-batches a batch of ``samples`` is cut into: ``chunks``, or one per sample where an
    epoch's smaller last batch holds fewer (an accumulation loop over a DataLoader never sees an empty
    micro-batch); one, empty, for an empty DDP shard, so that its rank still joins the all-reduce."""
    return max(1, min(chunks, samples))


def chunk_pairs(batch: Batch, chunks: int) -> list[tuple[Tensor, Tensor]]:
    """``chunks`` (inputs, targets) micro-batches of near-equal size (12 samples in 5: 3, 3, 2, 2, 2);
    fewer where the batch holds fewer samples (see :func:`micro_batch_count`)."""
    count = micro_batch_count(len(batch), chunks)
    return list(zip(batch.inputs.tensor_split(count), batch.targets.tensor_split(count)))


class CommunicationCounter(Protocol):
    wrappers: int  # the wrappers it counts: a faithful step synchronises each ``syncs_per_step`` times
    counts_syncs: bool  # False: it counts traffic by kind only (a pipeline has no gradient sync)

    last_step: dict[str, tuple[int, int]]  # after take(): every collective of that step, kind -> (calls, bytes)

    def counting(self) -> AbstractContextManager:
        """While training: count what is called through torch.distributed besides the wrappers' syncs."""

    def take(self) -> tuple[int, int]:
        """The synchronisations and bytes per rank since the last call: one optimizer step's worth."""


@dataclasses.dataclass(frozen=True)
class Chunked(Regime):
    """A regime that cuts the global batch into ``chunks`` micro-batches (possibly uneven)."""

    anchorable: ClassVar[bool] = True
    chunks: int

    def __post_init__(self) -> None:
        expect_int("chunks", self.chunks)

    def validate(self, case: Case) -> None:
        super().validate(case)
        if self.chunks > case.batch_size:
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: chunks={self.chunks} is not allowed: expected an "
                f"integer from 1 to {case.batch_size} (the case's batch_size)"
            )

    def micro_batches(self, case: Case) -> int:
        return self.chunks


REGIMES: dict[str, type[Regime]] = {}


def register_regime(cls: type[Regime]) -> type[Regime]:
    """Make a regime class reachable by its spec name; a class decorator. Worker ranks import the
    module that defines a regime before they parse its spec, so a regime of your own is one module
    that calls this at its top level."""
    if cls.name in REGIMES and REGIMES[cls.name] is not cls:
        raise InvalidArgument.value("name", cls.name, f"a regime name not registered yet (it names "
                                    f"{REGIMES[cls.name].__module__}.{REGIMES[cls.name].__qualname__})")
    REGIMES[cls.name] = cls
    return cls


def regime_source(regime: Regime) -> str:
    """The module a worker rank imports to know ``regime``'s spec: the one that defines its class."""
    module = type(regime).__module__
    if module in ("__main__", "__mp_main__"):
        raise InvalidArgument(
            f"regime {str(regime)!r} is not allowed here: worker processes import the module that defines a regime, "
            "so distributed checks need a regime class defined in an importable module, not in __main__"
        )
    return module


DEFAULT_REGIMES = (
    "full_batch",
    "sample_by_sample",
    "accumulate:chunks=5",
    "retained_graph:chunks=5",
    "detached_partial:chunks=5",
    "ddp:world_size=2",
    "ddp_no_sync:world_size=2,chunks=3",
    "data_parallel",
)

_FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def parse_regime(spec: str | Regime) -> Regime:
    """``'accumulate:chunks=4'`` -> ``Accumulate(chunks=4)``; a Regime passes through."""
    if isinstance(spec, Regime):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgument.type("regime", spec, "a regime spec str such as 'accumulate:chunks=4'")
    if ">" in spec:
        return _joined(spec)
    name, _, params_text = spec.strip().partition(":")
    if name not in REGIMES:
        raise InvalidArgument.unknown("regime", name, REGIMES)
    cls = REGIMES[name]
    if "compile=" in params_text and "compile" not in {f.name for f in spec_fields(cls)}:
        from .compiled import compiled_class  # the regime's compiled subclass: compile is a wrap on any regime

        cls = compiled_class(cls)
    fields = {f.name: f for f in spec_fields(cls)}
    kwargs: dict[str, object] = {}
    for item in filter(None, params_text.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if key not in fields or not eq:
            allowed = ", ".join(f"{k}=..." for k in fields) or "no parameters"
            raise InvalidArgument(f"regime spec {spec!r}: {item!r} is not allowed: {name} takes {allowed}")
        if key in kwargs:
            raise InvalidArgument(f"regime spec {spec!r}: {key} is given twice: expected each parameter once")
        kwargs[key] = _convert(key, raw.strip(), _FIELD_TYPES[str(fields[key].type)])
    missing = [k for k, f in fields.items() if k not in kwargs and f.default is dataclasses.MISSING]
    if missing:
        example = ",".join(f"{k}={fields[k].metadata.get('example', 2)}" for k in missing)
        raise InvalidArgument(f"regime spec {spec!r}: {name} needs {', '.join(missing)} (e.g. '{name}:{example}')")
    return cls(**kwargs)


def _joined(spec: str) -> Regime:
    """``BEFORE>resume:at=K[>AFTER]``, or ``resume:at=K>AFTER``: the joining regime between the regimes it joins (a
    regime before it trains first; one after it takes over, else the one before does); a run restarted more than once
    goes on, ``A>resume:at=1>B>resume:at=2>C``."""
    parts = [part.strip() for part in spec.split(">")]
    joins = [bool(getattr(REGIMES.get(part.partition(":")[0]), "between", False)) for part in parts]
    # A resume somewhere, and never two regimes with no resume between them.
    if all(parts) and any(joins) and not any(not a and not b for a, b in zip(joins, joins[1:])):
        regime, at = (None, 0) if joins[0] else (parse_regime(parts[0]), 1)
        while at < len(parts):
            after = parse_regime(parts[at + 1]) if at + 1 < len(parts) and not joins[at + 1] else None
            regime = parse_regime(parts[at]).joined(regime, after)
            at += 1 if after is None else 2
        return regime
    raise InvalidArgument(f"regime spec {spec!r} is not allowed: '>' joins at most one regime on each side of a "
                          "resume, as 'BEFORE>resume:at=K>AFTER' (BEFORE trains first, AFTER takes over; either "
                          "may be left out: full_batch, and BEFORE; a second resume may follow)")


_PLACEHOLDERS = {"int": "N", "float": "X", "str": "NAME", "bool": "0|1"}


def spec_usage(name: str) -> str:
    """How a spec of regime ``name`` is written: its required parameters with a placeholder for their
    type, its optional ones in brackets with their defaults (``ddp:world_size=N[,backend=auto,...]``)."""
    fields = spec_fields(REGIMES[name])
    required = [f"{f.name}={_PLACEHOLDERS[str(f.type)]}" for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    optional = [f"{f.name}={_spec_value(f.default)}" for f in fields
                if f.default is not dataclasses.MISSING and not f.metadata.get("derived")]
    usage = name + (":" + ",".join(required) if required else "")
    if optional:
        usage += "[" + ("," if required else ":") + ",".join(optional) + "]"
    return usage


def spec_fields(regime: Regime | type[Regime]) -> list[dataclasses.Field]:
    """A regime's fields in the order a spec writes them: declaration order, the trailing ones (a declaration of what
    a step communicates) last; not the regimes a resume joins, which its spec writes around it."""
    return sorted((f for f in dataclasses.fields(regime) if not f.metadata.get("joined")),
                  key=lambda field: bool(field.metadata.get("trailing")))


def _spec_value(value: object) -> str:
    """A field's value as a spec writes it: a bool as 1 or 0, which parses back to itself."""
    return str(int(value)) if isinstance(value, bool) else str(value)


def _convert(key: str, raw: str, kind: type) -> object:
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise InvalidArgument.type(key, raw, kind.__name__) from None
    if kind is bool:
        if raw not in ("0", "1", "true", "false"):
            raise InvalidArgument.value(key, raw, "one of 0, 1, true, false")
        return raw in ("1", "true")
    return raw


def expect_max_norm(max_norm: float) -> None:
    """A clipping threshold: a number > 0; inf (the default) clips nothing."""
    if max_norm != math.inf:
        expect_number("max_norm", max_norm, minimum=0, maximum=math.inf, strict=True)
