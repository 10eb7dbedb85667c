"""deepspeedai/DeepSpeed#8437: under AutoTP, Muon orthogonalised each rank's shard, so its update depended on TP.

With ``autotp_size > 1`` DeepSpeed hands Muon each rank's column-parallel shard of an attention projection (AutoTP
replaces the parameter's ``.data`` by its partition), and Muon's Newton-Schulz runs on that block of rows. Orthogonalising
a block of rows is another computation than taking those rows out of the orthogonalised matrix, so the update under
AutoTP is not the update without it: the report measures gradients that agree to 7e-7 between tp=1 and tp=2 and
updates that differ by 0.39 relative (cosine 0.936, norm 11% larger) on a Llama's q_proj. The issue was open, with no
fix named, when this row was written; the run as fixed here gathers each sharded matrix for Newton-Schulz and keeps
its own rows, as Megatron's TensorParallelMuon does in its "duplicated" mode (NVIDIA/Megatron-LM pull #6380 made that
its default, for the same reason). The team's Muon is Keller Jordan's ``muon_update`` (momentum lerp, Nesterov, the
quintic Newton-Schulz, the sqrt(max(1, rows / columns)) scale), as DeepSpeed's ``original_muon.py`` has it, in the
case's float64 rather than bfloat16; tensors that are no matrix take the momentum step alone, as MuonWithAuxAdam
hands them to another optimizer. The model is the tensor rows' TinyGPT, ``up`` column-parallel as q_proj is.
"""

import dataclasses

import torch

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.field._muon import muon_update
from equivcheck_cases.field._tensor import TinyGPT, megatron_parallelize, token_case, token_step

BUG = Bug("deepspeedai/DeepSpeed", "issue", 8437, "optimizer",
          "Muon under AutoTP ran Newton-Schulz on each rank's column shard: the update depends on the TP degree",
          fixed_by="open; each sharded matrix gathered for Newton-Schulz, its rows kept (Megatron's duplicated mode)",
          fix_acts="optimizer up")


class Muon(torch.optim.Optimizer):
    """Muon for the matrices, the momentum step alone for the rest. ``whole_matrix``: a sharded matrix's gradient and
    momentum gathered (every rank computes the whole update alike) and this rank's rows of the update applied; else
    the rank's shard is what Muon sees, as AutoTP hands it over."""

    def __init__(self, params, lr=0.02, momentum=0.95, whole_matrix=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, whole_matrix=whole_matrix))

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, distribute_tensor

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                sharded = isinstance(p.grad, DTensor)
                grad = p.grad.full_tensor() if sharded and group["whole_matrix"] else \
                    p.grad.to_local() if sharded else p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                if grad.ndim < 2:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(grad)
                    update = state["momentum_buffer"]
                else:
                    update = muon_update(grad.clone(), state["momentum_buffer"], beta=group["momentum"])
                if sharded and group["whole_matrix"]:
                    update = distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None).to_local()
                (p.to_local() if sharded else p).add_(update, alpha=-group["lr"])


def muon(parameters):
    return Muon(parameters)


def muon_as_reported(parameters):
    return Muon(parameters, whole_matrix=False)


GPT = ec.register_case(dataclasses.replace(
    token_case("field_deepspeed_muon_gpt", TinyGPT, "TinyGPT under the whole-matrix Muon"), optimizer=muon))
GPT_AS_REPORTED = ec.register_case(dataclasses.replace(
    token_case("field_deepspeed_muon_gpt_as_reported", TinyGPT, "TinyGPT under a Muon handed each rank's shard"),
    optimizer=muon_as_reported))


def tensor_parallel(model, mesh):
    return megatron_parallelize(model, mesh, sequence_parallel=False)


def buggy():
    return ec.check_step(GPT_AS_REPORTED, token_step, mesh={"tp": 2}, parallelize=tensor_parallel)


def fixed():
    return ec.check_step(GPT, token_step, mesh={"tp": 2}, parallelize=tensor_parallel)
