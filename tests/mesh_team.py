"""A team's own tensor-parallel code, as the ranks import it by name: its plan (TP alone, or FSDP2 over dp beside
TP over tp), its step, and the step as a bug report would have it (the loss divided by the TP size)."""

import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def tensor_parallel(model, mesh):
    return parallelize_module(model, mesh["tp"], PLAN)


def fsdp_and_tensor_parallel(model, mesh):
    """torchtitan's order: TP inside each block first, then FSDP2 over the data-parallel dimension."""
    model = parallelize_module(model, mesh["tp"], PLAN)
    return fully_shard(model, mesh=mesh["dp"])


def returns_nothing(model, mesh):
    parallelize_module(model, mesh["tp"], PLAN)


def train_step(model, optimizer, batch):
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets)  # this data-parallel shard's mean
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def train_step_divided_by_tp(model, optimizer, batch):
    """Each TP rank counted as a data-parallel one: the loss over the TP size, every gradient too small."""
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs), targets) / 2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach() * 2


def train_step_gathering_again(model, optimizer, batch):
    """Debugging code left in a step: the rowwise Linear's weight gathered whole once per step (an all-gather over tp);
    the numbers unchanged."""
    from torch.distributed.tensor import Replicate

    model[2].weight.detach().redistribute(placements=[Replicate()])
    return train_step(model, optimizer, batch)


def train_step_logging_the_mean_loss(model, optimizer, batch):
    """The loss a team logs, all-reduced over every rank after the step: one more all_reduce per call."""
    loss = train_step(model, optimizer, batch)
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def train_loop(model, optimizer, batches):
    return [train_step(model, optimizer, batch) for batch in batches]


def rank() -> int:
    return dist.get_rank()


def sequence_over_cp(model, mesh):
    """No sharded parameters: the team's step cuts the sequence over cp itself (a per-token model needs no ring), and
    averages over dp itself."""
    model.cp = mesh["cp"]
    model.dp = mesh["dp"] if "dp" in mesh.mesh_dim_names else None
    return model


def _cp_step(model, optimizer, batch, reduce: bool):
    """This cp rank's part of the sequence: its tokens' loss sum over the data-parallel shard's tokens, the gradients
    summed over cp (``reduce``) and averaged over dp, the loss summed over cp for the report."""
    inputs, targets = batch  # this data-parallel group's shard, the same on every cp rank
    cp = model.cp
    mine, theirs = (t.tensor_split(cp.size(), dim=1)[cp.get_local_rank()] for t in (inputs, targets))
    loss = F.cross_entropy(model(mine).flatten(0, 1), theirs.flatten(), reduction="sum") / targets.numel()
    loss.backward()
    for param in model.parameters():
        if reduce:
            dist.all_reduce(param.grad, group=cp.get_group())
        if model.dp is not None:
            dist.all_reduce(param.grad, group=model.dp.get_group())
            param.grad /= model.dp.size()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp.get_group())
    return total


def train_step_over_cp(model, optimizer, batch):
    return _cp_step(model, optimizer, batch, reduce=True)


def train_step_over_cp_unreduced(model, optimizer, batch):
    """The bug: each cp rank steps on its own tokens' gradients, never summed over the sequence's ranks."""
    return _cp_step(model, optimizer, batch, reduce=False)


# A team's own Megatron-style layers on raw collectives: tp_mlp's Linears as plain local shards (the first by its
# output features, the second by its input features), the forward's all-reduce and the backward's by hand, and the
# team's gather that reads a shard back whole for the check.
import torch  # noqa: E402
from torch import nn  # noqa: E402

TEAM = {}  # what the team's parallelize leaves for its gather: its TP group


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: all-reduce in the forward, identity in the backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MegatronMLP(nn.Sequential):
    """Linear (this rank's output features), GELU, Linear (this rank's input features, its partial outputs
    all-reduced, the bias added once): the names are tp_mlp's, the weights plain tensors."""

    def forward(self, x):
        up, act, down = self
        return _ReduceFromRegion.apply(F.linear(act(up(x)), down.weight), TEAM["group"]) + down.bias


SHARDED_DIMS = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # 2.bias is whole on every rank


def megatron_shards(model, mesh):
    tp = mesh["tp"]
    TEAM["group"] = tp.get_group()
    for name, dim in SHARDED_DIMS.items():
        module, _, key = name.partition(".")
        whole = getattr(model[int(module)], key).detach()
        setattr(model[int(module)], key, nn.Parameter(whole.chunk(tp.size(), dim)[tp.get_local_rank()].clone()))
    return MegatronMLP(*model)


def megatron_new_layers(model, mesh):
    """The same shards in new layers, the case's model left as it was: Megatron-style conversion code returns a new
    module, and the original's parameters are never trained."""
    tp = mesh["tp"]
    TEAM["group"] = tp.get_group()
    up, act, down = model
    new_up, new_down = nn.Linear(up.in_features, up.out_features // tp.size()), nn.Linear(down.in_features // tp.size(),
                                                                                           down.out_features)
    with torch.no_grad():
        for new, old in ((new_up, up), (new_down, down)):
            for key in ("weight", "bias"):
                whole = getattr(old, key).detach()
                dim = SHARDED_DIMS.get(f"{0 if old is up else 2}.{key}")
                getattr(new, key).copy_(whole if dim is None else whole.chunk(tp.size(), dim)[tp.get_local_rank()])
    return MegatronMLP(new_up.to(up.weight.dtype), act, new_down.to(up.weight.dtype))


def gather_shards(name, local):
    """The whole of ``name`` from this rank's shard: the shards all-gathered over the TP group, in rank order."""
    dim = SHARDED_DIMS.get(name)
    if dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(TEAM["group"]))]
    dist.all_gather(parts, local.contiguous(), group=TEAM["group"])
    return torch.cat(parts, dim)


# tp_mlp with 25 samples: its third global batch holds one, which both ranks of a TP group see.
import dataclasses  # noqa: E402

import equivcheck as ec  # noqa: E402

_TP_MLP = ec.get_case("tp_mlp")
SHORT_TAIL = ec.register_case(dataclasses.replace(_TP_MLP, name="tp_mlp_short_tail", last_batch="keep",
                                                  data=lambda: tuple(t[:25] for t in _TP_MLP.data())))


def data_parallel_in_pairs(model, mesh):
    """FSDP2 over dp, and the team's own groups of two ranks (an expert-parallel habit), made on every rank."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    TEAM["pair"] = pairs[dist.get_rank() // 2]
    return fully_shard(model, mesh=mesh["dp"])


def train_step_syncing_a_pair(model, optimizer, batch):
    """A faithful step, then a tensor exchanged within the rank's pair (the numbers untouched)."""
    loss = train_step(model, optimizer, batch)
    dist.all_reduce(loss.clone(), group=TEAM["pair"])
    return loss


class MegatronMLPBiasOnce(nn.Sequential):
    """As MegatronMLP, the row bias held by the TP group's first rank alone and added there before the all-reduce:
    the other ranks hold no part of it (no parameter of that name)."""

    def forward(self, x):
        up, act, down = self
        return _ReduceFromRegion.apply(F.linear(act(up(x)), down.weight, down.bias), TEAM["group"])


def megatron_bias_on_first_rank(model, mesh):
    mlp = megatron_shards(model, mesh)
    TEAM["bias"] = (mlp[2].bias.shape, mlp[2].bias.dtype)
    if mesh["tp"].get_local_rank():
        del mlp[2].bias
        mlp[2].bias = None
    return MegatronMLPBiasOnce(*mlp)


def gather_shards_and_the_bias(name, local):
    """The shards as gather_shards reads them; the bias from the first rank, which alone holds it (``local`` is None
    on the others)."""
    if name != "2.bias":
        return gather_shards(name, local)
    shape, dtype = TEAM["bias"]
    whole = local.detach().clone() if local is not None else torch.empty(shape, dtype=dtype)
    dist.broadcast(whole, dist.get_global_rank(TEAM["group"], 0), group=TEAM["group"])
    return whole


class RowParallelLinear(nn.Linear):
    """Megatron's RowParallelLinear as a module: this rank's input features, its partial outputs all-reduced, the bias
    added once, after the reduction."""

    def forward(self, x):
        return _ReduceFromRegion.apply(F.linear(x, self.weight), TEAM["group"]) + self.bias


class RowParallelLinearBiasOnEveryRank(RowParallelLinear):
    """Wrong: the bias added on every TP rank before the all-reduce, so the output holds it TP times."""

    def forward(self, x):
        return _ReduceFromRegion.apply(F.linear(x, self.weight, self.bias), TEAM["group"])


def _row_parallel(model, mesh, kind):
    up, act, down = megatron_shards(model, mesh)
    row = kind(down.in_features, down.out_features, dtype=down.weight.dtype)
    row.weight, row.bias = down.weight, down.bias
    return nn.Sequential(up, act, row)


def row_parallel_layers(model, mesh):
    """tp_mlp's second Linear as the team's RowParallelLinear module, its first sharded by output features."""
    return _row_parallel(model, mesh, RowParallelLinear)


def row_parallel_bias_on_every_rank(model, mesh):
    return _row_parallel(model, mesh, RowParallelLinearBiasOnEveryRank)
