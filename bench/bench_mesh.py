"""What a check on 4 ranks (a 2 x 2 mesh) costs beside one on 2, and beside torch alone doing the same training.

    python bench/bench_mesh.py [--repeats N] [--busy]

equivcheck: the built-in ``tp_mlp`` checked under ``tp:world_size=2`` and ``fsdp_tp:dp=2,tp=2`` on a warm pool
(the pool started and one check done before timing), median of N checks; a check is the reference twice in this
process and the regime once on its ranks. torch alone: the same model, data and plan, trained the same 3 steps by
``parallelize_module`` (and ``fully_shard`` over ``dp``) in a process group of 2 and of 4 spawned ranks, timed on
the ranks after one untimed training (the median of N, rank 0's), beside the same 3 steps in one process: the work
of a check with none of its harness.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_threads import busy_neighbour  # noqa: E402

import equivcheck as ec  # noqa: E402
from equivcheck_cases.tensor_parallel import data, model  # noqa: E402

REGIMES = {"2 ranks (tp:world_size=2)": ("tp:world_size=2", 1, 2), "4 ranks (fsdp_tp:dp=2,tp=2)": ("fsdp_tp:dp=2,tp=2", 2, 2)}
STEPS, BATCH = 3, 12


def one_training(module, dp_rank: int, dp: int) -> None:
    torch.manual_seed(0)
    inputs, targets = data()
    inputs = inputs.double()  # the case trains in float64
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = inputs[step * BATCH:(step + 1) * BATCH], targets[step * BATCH:(step + 1) * BATCH]
        x, y = x.tensor_split(dp)[dp_rank], y.tensor_split(dp)[dp_rank]
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def torch_alone(rank: int, world: int, dp: int, repeats: int, port: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    times = []
    for attempt in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        module = parallelize_module(model().double(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if dp > 1:
            module = fully_shard(module, mesh=mesh["dp"])
        one_training(module, rank // (world // dp), dp)
        dist.barrier()
        if attempt:
            times.append(time.perf_counter() - started)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def free_port() -> int:
    """A port nothing listens on now: a fixed one may still be held by a run before (gloo then aborts the rank)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--busy", action="store_true", help="beside a loop on every core")
    args = parser.parse_args(argv)
    with busy_neighbour(args.busy):
        single = []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            one_training(model().double(), 0, 1)
            single.append(time.perf_counter() - started)
        print(f"torch alone, one process, 3 steps: {statistics.median(single[1:]) * 1e3:.1f} ms")
        context = mp.get_context("spawn")
        for label, (spec, dp, tp) in REGIMES.items():
            ec.check("tp_mlp", [spec])  # the pool started, the ranks' lazy imports done
            checks = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                ec.check("tp_mlp", [spec]).assert_equivalent()
                checks.append(time.perf_counter() - started)
            queue = context.SimpleQueue()
            mp.start_processes(torch_alone, args=(dp * tp, dp, args.repeats, free_port(), queue),
                               nprocs=dp * tp, start_method="spawn")
            alone = queue.get()
            check = statistics.median(checks)
            print(f"{label}: check {check * 1e3:.0f} ms (warm pool); torch alone on its ranks {alone * 1e3:.0f} ms; "
                  f"check / torch alone {check / alone:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
