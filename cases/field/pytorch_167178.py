"""pytorch/pytorch#167178: FSDP2 ignored a custom gradient divide factor when its shard group held one rank.

torchtitan wraps expert-parallel experts in ``fully_shard`` on a mesh whose shard dimension can hold a single rank
(expert-parallel degree equal to the world size) and sets ``set_gradient_divide_factor`` so those gradients are
averaged like the dense ones. For fp32 and bf16 reductions FSDP2 carried the custom factor in the reduce-scatter's
reduce op (a pre-multiplied sum); with one rank in the shard group it skipped the reduce-scatter, copied the local
gradient as it was, and the replica all-reduce then summed: the experts' gradients came out world-size times the
average one process computes over the global batch. The fix divides by the factor on that one-rank path too.
Nothing in the team's code differs between the two: the bug and its fix live inside torch (see ``not_expressible``).
"""

import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/pytorch", "pull", 167178, "fsdp",
          "gradient_divide_factor skipped when the FSDP2 shard group had 1 rank: grads world-size x too large",
          not_expressible="the installed torch 2.13 has the fix, and the team's code is the same before and after "
                          "it. Measured with the step and wrap below on 2 ranks (2 replicas x 1 shard), divide "
                          "factor 2: on a float32 copy of block_stack the one-rank path divides and the gradients "
                          "match one process (margin 0.00885). In float64 (a dtype FSDP2 pre-divides) torch 2.13 "
                          "divides twice on this path, by its pre-divide factor and again by the fix's explicit "
                          "division: gradients come out 0.5x (measured through check_step and by hand), a separate "
                          "fault with no report here. Reproducing the reported arithmetic needs a torch without the "
                          "fix; set_gradient_divide_factor(1) gives the same numbers but is a different mistake in "
                          "team code, not this bug")

EXPERT_DIVIDE_FACTOR = 2.0  # the world size: the experts' gradients averaged over the global batch


def hsdp_one_shard(model):
    """The team's wrap: a (dp_replicate = W) x (dp_shard = 1) mesh, every block and the root with the factor set."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
            block.set_gradient_divide_factor(EXPERT_DIVIDE_FACTOR)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(EXPERT_DIVIDE_FACTOR)
    return model


def train_step(model, optimizer, batch):
    """This rank's loss sum over the global sample count, times the world size: averaged, the global mean."""
    inputs, targets = batch
    samples = inputs.new_tensor(float(len(inputs)))
    dist.all_reduce(samples)
    loss = F.cross_entropy(model(inputs), targets, reduction="sum") * dist.get_world_size() / samples
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()
