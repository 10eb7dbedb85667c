"""Sequence parallelism with tensor parallelism (Megatron-style SP, torchtitan's plan) over W ranks: activations of
shape (batch, sequence, features) sharded on the sequence outside the tensor-parallel Linears, every rank seeing the
whole global batch.

A ``'sequence'`` module of the case's plan (a norm, dropout) runs under ``SequenceParallel()``: its input and output
sharded on the sequence (dim 1), its weight and bias replicated (DTensors, whose gradients DTensor all-reduces over
the ranks: each rank's norm sees only its own tokens). A ``'colwise'`` Linear takes sequence-sharded input
(``input_layouts=Shard(1)``: all-gathered in the forward, reduce-scattered in the backward), a ``'rowwise'`` one gives
sequence-sharded output (``output_layouts=Shard(1)``: reduce-scattered instead of all-reduced). The model's input,
whole on every rank, is cut on the sequence where it enters the model (``PrepareModuleInput``); a module with
parameters left out of the plan (a head) is replicated (its parameters replicated DTensors; a Linear runs with the
sequence moved first, see ``_sequence_first``), and the model's output is gathered whole (``full_tensor``) for the loss, which every rank computes on the whole global batch as under ``tp``.
Every style keeps DTensors between modules (``use_local_output=False``), so the code between them (a residual add, a
mean over the sequence) runs unchanged.

``tp_sp_norm_unreduced`` is the reported bug (NVIDIA/Megatron-LM#1446, EleutherAI/gpt-neox#1259): the norm applied
Megatron's way, its weight and bias plain tensors replicated by hand on each rank, on the rank's own sequence shard,
and the all-reduce of their gradients over the TP group (Megatron's ``_allreduce_layernorm_grads``, the gradient
finalizer's) missing for it: each rank's norm gradient holds only its own tokens' part, and the replicas drift apart.
Every ``'sequence'`` module with parameters is run so, a norm or an adapter's replicated factor (modelscope/mcore-bridge
pull #173: a LoRA factor never flagged for that all-reduce; the ``lora_sp_block`` case).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree

from ..case import TP_STYLES, Case
from ..errors import InvalidArgument
from ..process.seeding import DEFAULT_SEED, seeded
from ..process.torch_imports import is_dtensor
from .base import Pitfall
from .tensor import DpTpMesh, TensorParallel, frozen_kept, localize_heads

SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


def sequence_plan_style(style: str):
    """torch's ParallelStyle for a plan's style name under sequence parallelism: the tensor-parallel Linears take and
    give sequence-sharded activations, a ``'sequence'`` module runs on them; every output stays a DTensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style == "colwise":
        return ColwiseParallel(input_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
    if style == "colwise_local":  # attention's projections: the sequence gathered, the rank's heads kept local
        return ColwiseParallel(input_layouts=Shard(SEQUENCE_DIM))
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
    if style == "sequence":
        return SequenceParallel(sequence_dim=SEQUENCE_DIM)
    raise InvalidArgument.value("style", style, ", ".join(map(repr, TP_STYLES)))


def _whole(output):
    """The model's output (a tensor, or tensors in a tuple or mapping) gathered whole: plain tensors the loss takes."""
    return _pytree.tree_map(lambda t: t.full_tensor() if is_dtensor(t) else t, output)


def _sequence_first(linear: nn.Linear) -> None:
    """A Linear the plan leaves out (a per-token head) run with the sequence moved first and back. A Linear folds the
    dims before its features into one, and torch 2.11's DTensor folds a sharded dim only where it leads (2.13 folds
    any): so the head computes the same per-token products on the same sequence shards, with the same traffic, in
    every torch. A Linear keeps the number of dims: its output is moved back where its input was moved."""
    linear.register_forward_pre_hook(
        lambda module, args: (args[0].transpose(0, SEQUENCE_DIM), *args[1:]) if args[0].dim() > 2 else None)
    linear.register_forward_hook(
        lambda module, args, output: output.transpose(0, SEQUENCE_DIM) if output.dim() > 2 else None)


def _replicate_the_rest(model: nn.Module, mesh, keep_plain: set[str]) -> None:
    """Every parameter the plan left plain made a replicated DTensor (the same on every rank, as seeded), so that a
    module outside the plan (a head) can take DTensor activations; ``keep_plain``: modules whose parameters stay plain
    tensors (a Megatron-style norm)."""
    from torch.distributed.tensor import DTensor, Replicate

    for name, module in model.named_modules():
        if name in keep_plain:
            continue
        for key, param in list(module.named_parameters(recurse=False)):
            if not is_dtensor(param):
                module.register_parameter(key, nn.Parameter(
                    DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False),
                    requires_grad=param.requires_grad))


@dataclasses.dataclass(frozen=True)
class TensorSequenceParallel(TensorParallel):
    name = "tp_sp"
    summary = ("tensor with sequence parallelism (Megatron-style SP): the case's plan over W ranks, activations "
               "sharded on the sequence around colwise/rowwise Linears, 'sequence' modules (norms) on sequence shards")
    shards_sequence = True

    def validate(self, case: Case) -> None:
        """The plan must hold a ``'sequence'`` module, and the case's inputs must be (batch, sequence, ...) with a
        sequence that divides over the ranks: read off the case's data built once, seeded."""
        super().validate(case)
        plan = case.tp_plan or {}
        if "sequence" not in plan.values():
            raise InvalidArgument(
                f"case {case.name!r} has no sequence-parallel module in its tensor-parallel plan: regime "
                f"{str(self)!r} expected tp_plan= naming a norm (or dropout) 'sequence', beside its colwise and "
                "rowwise Linears")
        try:
            with seeded(DEFAULT_SEED):
                inputs = case.data()[0]
        except Exception:  # data that cannot be built here: training tells
            return
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 3 or inputs.shape[SEQUENCE_DIM] % self.tp_size:
            shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise InvalidArgument(
                f"regime {str(self)!r} on case {case.name!r}: its inputs of shape {shape} are not allowed: expected "
                f"(samples, sequence, features), a sequence (dim {SEQUENCE_DIM}) that divides over "
                f"{self.tp_size} ranks")

    def over_tp(self, model: nn.Module, plan: dict[str, str], mesh) -> nn.Module:
        """``plan`` applied over ``mesh`` (one dimension: the TP group), activations sharded on the sequence."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

        localize_heads(model, plan, self.tp_size)
        plain = self.plain_norms(model, plan)
        with frozen_kept(model):
            parallelize_module(model, mesh, {name: sequence_plan_style(style) for name, style in plan.items()
                                             if name not in plain})
            for name in plain:
                _megatron_norm(model.get_submodule(name), mesh)
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear) and not is_dtensor(module.weight) and name not in plain:
                    _sequence_first(module)
            _replicate_the_rest(model, mesh, set(plain))
        # The input, whole on every rank, cut on the sequence where it enters; the output gathered whole for the loss.
        parallelize_module(model, mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Shard(SEQUENCE_DIM),),
                                                           use_local_output=False))
        model.register_forward_hook(lambda module, args, output: _whole(output))
        return model

    def plain_norms(self, model: nn.Module, plan: dict[str, str]) -> list[str]:
        """The ``'sequence'`` modules applied Megatron's way, their parameters plain tensors: none here."""
        return []


@dataclasses.dataclass(frozen=True)
class FsdpTensorSequenceParallel(DpTpMesh, TensorSequenceParallel):
    """``tp_sp`` over ``tp`` and FSDP2 over ``dp`` on a ``dp x tp`` mesh (torchtitan's 2-D layout with SP)."""

    name = "fsdp_tp_sp"
    summary = "FSDP2 over dp and the case's TP plan with sequence parallelism over tp: a dp x tp mesh"


def _megatron_norm(module: nn.Module, mesh) -> None:
    """``module`` run as Megatron runs a sequence-parallel norm: on this rank's sequence shard as a plain tensor, its
    parameters plain tensors (replicated by construction: every rank built them from the same seed), its output
    handed on as that rank's shard (the next colwise Linear all-gathers it, and reduce-scatters its gradient back)."""
    from torch.distributed.tensor import DTensor, Shard

    def local(module, args):
        x = args[0]
        if is_dtensor(x):
            x = x.redistribute(placements=[Shard(SEQUENCE_DIM)]).to_local()
        return (x, *args[1:])

    def sharded(module, args, output):
        return DTensor.from_local(output, mesh, [Shard(SEQUENCE_DIM)], run_check=False)

    module.register_forward_pre_hook(local)
    module.register_forward_hook(sharded)


@dataclasses.dataclass(frozen=True)
class TensorSequenceParallelNormUnreduced(TensorSequenceParallel):
    name = "tp_sp_norm_unreduced"
    summary = ("PITFALL: sequence-parallel norms Megatron's way (plain weights on each rank's sequence shard) with "
               "their gradients never all-reduced over the TP group: each rank's holds its own tokens' part")
    pitfall = Pitfall("sequence-parallel norm gradients not all-reduced over tensor parallelism", twin="tp_sp")
    # Megatron's fix (finalize_model_grads' _allreduce_layernorm_grads): the norms' gradients summed over the TP group
    # after the backward. Missing here, as in the reports; a subclass that sets it is Megatron's faithful way.
    allreduce_norm_grads = False

    def plain_norms(self, model: nn.Module, plan: dict[str, str]) -> list[str]:
        modules = dict(model.named_modules())
        return [name for name, style in plan.items()
                if style == "sequence" and any(True for _ in modules[name].parameters())]

    def finalize_grads(self, model: nn.Module) -> None:
        if not self.allreduce_norm_grads:
            return
        for param in model.parameters():  # the plain ones are the norms': every other parameter is a DTensor
            if not is_dtensor(param) and param.grad is not None:
                dist.all_reduce(param.grad)
