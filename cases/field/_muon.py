"""What the field's Muon rows share: Keller Jordan's Muon as DeepSpeed ships it (``original_muon.py``), DeepSpeed's
``MuonWithAuxAdam`` and the flags that route each parameter to it, the MLP case trained with it, and DeepSpeed's ZeRO
partitions written in plain PyTorch on gloo ranks.

DeepSpeed's optimizers need CUDA, so the rows re-create the code paths at stake. ``set_optimizer_flags`` tags a
parameter ``use_muon`` by ``p.ndim >= 2`` and its name (no "embed", no "lm_head"); the engine then builds
``MuonWithAuxAdam`` with a Muon group (sorted by size, largest first) and an Adam group. Under ZeRO the optimizer is
handed flat partitions: ZeRO-1/2 flatten each param group, pad it to a multiple of the data-parallel size and give rank
``r`` the ``r``-th equal slice; ZeRO-3 cuts each parameter's flattened data into chunks of ``ceil(numel / W)``. The ZeRO
optimizer runs ``muon_update`` on each whole matrix while it fills the partition, and ``MuonWithAuxAdam.step`` takes a
flat (1-D) parameter's gradient as the update already made (since pull #8442; a matrix it orthogonalises itself). Here
the ZeRO optimizer wraps the case's ``MuonWithAuxAdam`` (``optimizer_wrap``) on DDP ranks, whose all-reduce stands for
ZeRO's; the parameters stay whole on every rank between steps (ZeRO-3's gathering around each forward plays no part in
these bugs), each rank's optimizer steps its own partitions, and the partitions are all-gathered back into the
parameters at the end of the step. The gradient the harness reads is what the team's step hands over before ``step()``:
the gradient partitions as backward's reduces left them, gathered (``safe_get_full_grad``; the ZeRO optimizer's own step
reads its partitions, not ``p.grad``). The case is float64 (DeepSpeed's Newton-Schulz runs in bfloat16 on a GPU) and
uses the standard Newton-Schulz (``ns_method="standard"``; the Gram variant, DeepSpeed's default, is the same iteration
rearranged).
"""

import dataclasses
import math

import torch
import torch.distributed as dist

import equivcheck as ec

LR, MOMENTUM = 0.02, 0.95  # the config's "lr": both groups take it (no muon_lr or adam_lr)
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-10


def zeropower_via_newtonschulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G / (G.norm() + 1e-7)
    if G.size(-2) > G.size(-1):
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True):
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    update = zeropower_via_newtonschulz5(update, steps=ns_steps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def adam_update(grad, buf1, buf2, step, betas, eps):
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    buf1c = buf1 / (1 - betas[0] ** step)
    buf2c = buf2 / (1 - betas[1] ** step)
    return buf1c / (buf2c.sqrt() + eps)


def set_optimizer_flags(model, shape=lambda p: p.shape):
    """deepspeed.set_optimizer_flags: ``use_muon`` on every matrix that is no embedding or head, by ``shape(p)``
    (the parameter's own shape as DeepSpeed wrote it; ``ds_shape`` once pull #8438 fixed it)."""
    for name, p in model.named_parameters():
        p.use_muon = len(shape(p)) >= 2 and not any(keyword in name.lower() for keyword in ("embed", "lm_head"))


def muon_groups(parameters, model=None):
    """The engine's param groups for ``MuonWithAuxAdam`` from the flags (set here by the parameters' own shapes
    where nothing set them: one process, no ``deepspeed.initialize``): the Muon group, largest first, then Adam's."""
    parameters = list(parameters)
    if model is not None and not all(hasattr(p, "use_muon") for p in parameters):
        set_optimizer_flags(model)
    muon = [p for p in parameters if p.use_muon]
    adam = [p for p in parameters if not p.use_muon]
    groups = []
    if muon:
        groups.append(dict(params=sorted(muon, key=lambda p: p.size(), reverse=True), use_muon=True, lr=LR,
                           momentum=MOMENTUM, weight_decay=0.0))
    if adam:
        groups.append(dict(params=adam, use_muon=False, lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0))
    return groups


class MuonWithAuxAdam(torch.optim.Optimizer):
    """deepspeed/runtime/zero/muon/muon_optimizer.py's step. Adam's group takes ``adam_update``. A Muon group's
    parameter that is a matrix is orthogonalised here (``muon_update`` with its momentum), and a flat one (a ZeRO
    partition) carries the update in its gradient already: the step as pull #8442 left it. ``runs_muon=False``: the
    step before #8442, every Muon parameter's gradient taken as the update, the weight itself too."""

    def __init__(self, param_groups, runs_muon=True):
        super().__init__(param_groups, dict())
        self.runs_muon = runs_muon

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                state = self.state[p]
                if group["use_muon"]:
                    if p.dim() < 2 or not self.runs_muon:
                        update = p.grad.reshape(p.shape)  # a flat ZeRO partition: the update made already
                    else:
                        if len(state) == 0:
                            state["momentum_buffer"] = torch.zeros_like(p)
                        update = muon_update(p.grad.clone(), state["momentum_buffer"], beta=group["momentum"])
                else:
                    if len(state) == 0:
                        state["exp_avg"], state["exp_avg_sq"], state["step"] = \
                            torch.zeros_like(p), torch.zeros_like(p), 0
                    state["step"] += 1
                    update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                                         group["betas"], group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])


def deepspeed_muon(parameters):
    """The case's optimizer: ``{"optimizer": {"type": "Muon"}}`` as DeepSpeed's engine builds it."""
    return MuonWithAuxAdam(muon_groups(parameters, getattr(parameters, "model", None)))


MLP = ec.register_case(dataclasses.replace(
    ec.get_case("mlp"), name="field_deepspeed_muon_mlp", optimizer=deepspeed_muon, regimes=("full_batch",),
    description="mlp under DeepSpeed's MuonWithAuxAdam: Muon for the two weight matrices, Adam for the biases"))


# ZeRO's partitions.


def flat_layout(groups, world):
    """ZeRO-1/2's flat partitions: each group's parameters flattened in order, padded to a multiple of ``world``,
    cut in equal slices. Per group: the slice size and each parameter's offset in the group's flat tensor."""
    layout = []
    for params in groups:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        layout.append((math.ceil(total / world), offsets))
    return layout


def all_gather_flat(partition):
    """Every rank's equal partition, concatenated in rank order."""
    pieces = [torch.empty_like(partition) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, partition.contiguous())
    return torch.cat(pieces)


class Wrapping(torch.optim.Optimizer):
    """A DeepSpeed optimizer around the one it is given (``optimizer_wrap``): it shares that optimizer's param groups,
    which hold the model's parameters between steps, and steps it on flat partitions (:meth:`step_partitions`)."""

    def __init__(self, optimizer):
        super().__init__([p for group in optimizer.param_groups for p in group["params"]], {})
        self.optimizer, self.param_groups = optimizer, optimizer.param_groups
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.groups = [list(group["params"]) for group in optimizer.param_groups]
        self.uses_muon = [group["use_muon"] for group in optimizer.param_groups]
        self.beta = next((group["momentum"] for group in optimizer.param_groups if group["use_muon"]), None)

    @torch.no_grad()
    def step_partitions(self, partitions):
        """Hand the optimizer each group's flat partition (its ``.grad`` set) in place of the group's parameters, step
        it and give the parameters back, as DeepSpeed's ZeRO and BF16 optimizers do."""
        for group, partition in zip(self.param_groups, partitions):
            group["params"] = [partition]
        try:
            self.optimizer.step()
        finally:
            for group, own in zip(self.param_groups, self.groups):
                group["params"] = own


def chunk_of(tensor, world, rank):
    """This rank's ZeRO-3 chunk of ``tensor`` flattened: ``ceil(numel / W)`` elements, zero-padded at the end."""
    size = math.ceil(tensor.numel() / world)
    piece = tensor.reshape(-1)[rank * size:(rank + 1) * size]
    chunk = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
    chunk[:piece.numel()] = piece
    return chunk


class Stage3(Wrapping):
    """DeepSpeedZeroOptimizer_Stage3 around the ``MuonWithAuxAdam`` it is given, cut down to its gradient and update
    path: each group's flat fp32 partition (every parameter's chunk, in order) with its gradient partition and its
    Muon momentum partition. ``reduce_partition`` is what each backward's reduce does
    (``__avg_scatter_contiguous_grads``), after the all-reduce that averages the gradients (DDP's here): each
    parameter's chunk accumulated into the gradient partition and ``p.grad`` freed; ``muon_in_reduce``: with Muon
    applied in that reduce first (``_apply_distributed_muon_update``: each matrix's momentum gathered, ``muon_update``
    on its whole reduced gradient, the gradient replaced by the update), as DeepSpeed wrote it; else in ``step`` on the
    accumulated gradient (pull #8600's ``_apply_muon_to_accumulated_grads``). DeepSpeed has each matrix's update made by
    one rank and all-gathered; here every rank makes them all, the same numbers."""

    def __init__(self, optimizer, muon_in_reduce):
        super().__init__(optimizer)
        self.muon_in_reduce = muon_in_reduce
        self.fp32 = [torch.cat([self._chunk(p.detach()) for p in params]) for params in self.groups]
        self.momentum = [torch.zeros_like(flat) for flat in self.fp32]
        self.grads = [None] * len(self.groups)

    def _chunk(self, tensor):
        return chunk_of(tensor, self.world, self.rank)

    def _spans(self, i):
        """Each parameter of group ``i`` with where its chunk lies in the group's flat partition."""
        offset = 0
        for p in self.groups[i]:
            size = math.ceil(p.numel() / self.world)
            yield p, slice(offset, offset + size)
            offset += size

    def _whole(self, chunk, p):
        return all_gather_flat(chunk)[:p.numel()].view(p.shape)

    def _muon(self, i, grads):
        """``muon_update`` on each whole gradient of Muon group ``i``, its momentum gathered from the partitions and
        this rank's chunk of it kept: the updates, whole."""
        updates = []
        for (p, span), grad in zip(self._spans(i), grads):
            momentum = self._whole(self.momentum[i][span], p).clone()
            updates.append(muon_update(grad.clone(), momentum, beta=self.beta))
            self.momentum[i][span] = self._chunk(momentum)
        return updates

    @torch.no_grad()
    def reduce_partition(self, micro_step_id):
        for i, group in enumerate(self.groups):
            grads = [p.grad for p in group]
            if self.muon_in_reduce and self.uses_muon[i]:
                grads = self._muon(i, grads)
            partition = torch.cat([self._chunk(grad) for grad in grads])
            self.grads[i] = partition if micro_step_id == 0 else self.grads[i] + partition
            for p in group:
                p.grad = None  # the partition holds it now

    def full_grads(self):
        """safe_get_full_grad of every parameter: its chunks of the gradient partitions, gathered."""
        for i in range(len(self.groups)):
            for p, span in self._spans(i):
                p.grad = self._whole(self.grads[i][span], p).clone()

    @torch.no_grad()
    def step(self, closure=None):
        for i in range(len(self.groups)):
            if not self.muon_in_reduce and self.uses_muon[i]:
                grads = [self._whole(self.grads[i][span], p) for p, span in self._spans(i)]
                self.grads[i] = torch.cat([self._chunk(update) for update in self._muon(i, grads)])
            self.fp32[i].grad = self.grads[i]
        self.step_partitions(self.fp32)
        for i in range(len(self.groups)):
            for p, span in self._spans(i):
                p.copy_(self._whole(self.fp32[i][span], p))
            self.fp32[i].grad, self.grads[i] = None, None
