"""What the field's clipping rows share: two small models run the way their teams parallelise them, their gradients
reduced as the owners of each weight need, then clipped by the team's own global norm; and the one-process references.

Expert parallelism: ``_moe.RoutedVectors`` (a trunk, a top-2 router over 4 experts, a head), run as
``_moe.expert_parallel_forward`` runs it: each rank routes the rows of its own data shard, the (row, expert)
slots travel to the expert's rank by ``all_to_all`` and back, so an expert's gradient on its owner already sums every
rank's tokens. The dense layers' gradients are averaged over the ranks (every rank a replica), the experts' divided by
the same count (their expert-data-parallel group is the owner alone). The reference is one process training the
global batch's mean loss and clipping its whole gradient once (``_references.clipped_once``).

A tied embedding under pipeline parallelism: ``TiedLM``, whose output layer's weight is its input embedding, cut into
two GPipe stages; each stage's process holds its own copy of the tied weight, the copies' gradients are all-reduced
between the stages (Megatron's ``_allreduce_word_embedding_grads``, DeepSpeed's ``allreduce_tied_weight_gradients``),
so each holds the sum of both uses. The reference (``clipped_tied_full_batch``) clips the one tied parameter once.

What a row changes is the clip that follows: which gradients a rank counts, and over which group it sums them.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import equivcheck as ec
from equivcheck_cases.field._moe import expert_parallel_forward, gather_experts, group, remember
from equivcheck_cases.field._references import clipped_once

MAX_NORM = 0.2  # below field_moe_vectors' full-batch gradient norm at both steps (0.61, then 0.33): clipping engages


def is_expert(name):
    return name.startswith("experts.")


def expert_parallel(model, mesh, **marks):
    """The experts spread over ``mesh['ep']`` (two to a rank), each expert parameter given the attributes ``marks``
    its framework sets on it (DeepSpeed's ``allreduce=False``, ColossalAI's ``moe_info``): a team's clip tells the
    experts apart by them."""
    remember(model, mesh, "ep")
    for name, parameter in model.named_parameters():
        if is_expert(name):
            for attribute, value in marks.items():
                setattr(parameter, attribute, value)
    return model


def gather(name, local):
    return gather_experts(name, local)


def reduce_gradients(model):
    """Data parallelism's reduction: the replicated layers' gradients averaged over the ranks; an expert's, already
    summed over every rank's tokens by the all_to_all's backward, divided by the same count (no replica to reduce)."""
    world = dist.get_world_size()
    for name, parameter in model.named_parameters():
        if parameter.grad is None:  # an expert another rank holds
            continue
        if not is_expert(name):
            dist.all_reduce(parameter.grad)
        parameter.grad.div_(world)


def expert_parallel_step(model, optimizer, batch, clip, reduce=reduce_gradients):
    """The team's step: this rank's mean loss over its routed shard, backward, the gradients reduced (``reduce``:
    data parallelism's by hand; None where FSDP2 reduces the replicated layers itself), the team's ``clip(model)``,
    one optimizer step."""
    inputs, labels = batch
    loss = F.cross_entropy(expert_parallel_forward(model, inputs), labels)
    loss.backward()
    if reduce is not None:
        reduce(model)
    clip(model)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def expert_parallel_check(step, reference, parallelize):
    """A row's check: the team's ``step`` on two expert-parallel ranks, its experts placed by ``parallelize``,
    against one process's ``reference``."""
    return ec.check_step("field_moe_vectors", step, reference, mesh={"ep": 2}, parallelize=parallelize, gather=gather)


def ep_group():
    return group()


def scale_(gradients, max_norm, total_norm):
    """Every gradient times ``max_norm / (total_norm + 1e-6)`` where that is below 1, as the teams' clips scale."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in gradients:
        g.mul_(coefficient)
    return total_norm


# A language model whose output layer is tied to its input embedding, cut into two pipeline stages: the first holds the
# embedding, the last the output layer, and each stage holds its own copy of the tied weight (Megatron's and
# DeepSpeed's pipelines both keep one per stage and all-reduce their gradients, so each copy holds the sum).

TIED_VOCAB, TIED_WIDTH, TIED_LENGTH = 12, 8, 6
MICRO_BATCHES = 2


class TiedLM(nn.Module):
    """embed -> two tanh layers -> final norm -> output layer, whose weight is the embedding's; its children run in
    order, so a pipeline cuts them (embed and the first layer on the first stage, the rest on the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(TIED_VOCAB, TIED_WIDTH)
        self.layer1 = nn.Sequential(nn.Linear(TIED_WIDTH, TIED_WIDTH), nn.Tanh())
        self.layer2 = nn.Sequential(nn.Linear(TIED_WIDTH, TIED_WIDTH), nn.Tanh())
        self.final_norm = nn.LayerNorm(TIED_WIDTH)
        self.head = nn.Linear(TIED_WIDTH, TIED_VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        hidden = tokens
        for child in self.children():
            hidden = child(hidden)
        return hidden


def tied_data():
    return (torch.randint(0, TIED_VOCAB, (24, TIED_LENGTH)), torch.randint(0, TIED_VOCAB, (24, TIED_LENGTH)))


def tied_token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, TIED_VOCAB), targets.reshape(-1), reduction="none")


tied_lm = ec.register_case(ec.Case(
    name="field_tied_lm", model=TiedLM, data=tied_data, loss=tied_token_loss, items=lambda targets: targets.numel(),
    batch_size=12, steps=2,
    description="embedding, two tanh layers, final norm, output layer tied to the embedding, over (12, 6) tokens"))


def tied_mean_loss(logits, targets):
    return tied_token_loss(logits, targets).mean()


def clipped_tied_full_batch(max_norm):
    """One process: the global batch's mean token loss, the whole gradient (the tied weight once, holding both its
    uses) clipped once to ``max_norm``, one step. Bind it at a module's top level."""
    return clipped_once(max_norm, tied_mean_loss)


def tied_pipeline_check(step, reference):
    """A row's check: the team's ``step`` factory on two GPipe stages against one process's ``reference``."""
    return ec.check_step("field_tied_lm", step, reference, world_size=2, pipeline=True, per_run=True)


def tied_stage(model):
    """This rank's stage: embed and layer1 on rank 0; layer2, the final norm and the output layer on rank 1, whose
    copy of the tied weight is the last stage's own (in its own process)."""
    from torch.distributed.pipelining import PipelineStage

    children = list(model.children())
    mine = children[:2] if dist.get_rank() == 0 else children[2:]
    return PipelineStage(nn.Sequential(*mine), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))


def allreduce_word_embedding_grads(model):
    """Megatron's ``_allreduce_word_embedding_grads`` (DeepSpeed's ``allreduce_tied_weight_gradients``): the tied
    weight's gradient summed over the stages that hold a copy, the first and the last."""
    dist.all_reduce(model.embed.weight.grad)


def tied_pipelined_step(after_backward):
    """The team's step, made afresh for every run (its stage and schedule built on the first call): GPipe over
    ``MICRO_BATCHES``, each micro-batch's token-loss sum over the global batch's token count, the tied weight's
    gradients all-reduced between the stages, then ``after_backward(stage_module, model)`` (the team's clip), one
    optimizer step. The last stage returns the loss."""
    from torch.distributed.pipelining import ScheduleGPipe

    schedule = stage = tokens = None

    def step(model, optimizer, batch):
        nonlocal schedule, stage, tokens
        inputs, targets = batch
        tokens = targets.numel()
        if schedule is None:
            stage = tied_stage(model)
            schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, scale_grads=False,
                                     loss_fn=lambda output, target: tied_token_loss(output, target).sum() / tokens)
        losses = []
        if dist.get_rank() == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        allreduce_word_embedding_grads(model)
        after_backward(stage.submod, model)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).sum().detach() if losses else None

    return step
