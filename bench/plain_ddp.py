"""The floor under a DDP check: the same training with torch alone, no equivcheck, as DDP and as accumulation.

bench_pool.py runs this in a fresh process and prints its figures beside equivcheck's, so a ratio target can be
read against what DDP itself costs here: the work of one job (build the model, wrap it, make the optimizer,
train every step) on ``--world-size`` gloo ranks forked from this process, against the same steps accumulated
in ``--world-size`` chunks in one process. Each rank takes every ``world_size``-th sample of a global batch and
scales its share of the global loss by ``world_size`` (DDP averages gradients). Prints one JSON line of medians.

    .venv/bin/python bench/plain_ddp.py --case mlp --world-size 2 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import equivcheck as ec
from timing import median_seconds


def case_of(name: str) -> ec.Case:
    case = ec.get_case(name)
    plain = (case.loss_reduction == "none" and case.forward is None and case.last_batch == "exact"
             and case.epochs == 1)
    if not plain:
        raise SystemExit(f"--case {name!r}: the plain loops here train a case with a per-item loss, its model "
                         "called on the inputs, one epoch of full batches; this case asks for more")
    return case


def batches(case: ec.Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    inputs, targets = case.data()
    inputs = inputs.to(case.dtype) if inputs.is_floating_point() else inputs
    return [(inputs[i:i + case.batch_size], targets[i:i + case.batch_size])
            for i in range(0, case.steps * case.batch_size, case.batch_size)]


def accumulate(case: ec.Case, data, chunks: int) -> None:
    torch.manual_seed(0)
    model = case.model().to(case.dtype)
    optimizer = case.optimizer(model.parameters())
    for inputs, targets in data:
        count = case.items(targets)
        for x, y in zip(inputs.tensor_split(chunks), targets.tensor_split(chunks)):
            (case.loss(model(x), y).sum() / count).backward()
        optimizer.step()
        optimizer.zero_grad()


def ddp_job(case: ec.Case, data, rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(case.model().to(case.dtype))
    optimizer = case.optimizer(model.parameters())
    for inputs, targets in data:
        count = case.items(targets)
        x, y = inputs[rank::world_size], targets[rank::world_size]
        (case.loss(model(x), y).sum() * world_size / count).backward()
        optimizer.step()
        optimizer.zero_grad()


def median_ms(action, repeats: int, before=lambda: None) -> float:
    """After three warm-up runs (the first builds what torch caches), the median milliseconds of ``action``."""
    for _ in range(3):
        action()
    return median_seconds(action, repeats, before=before) * 1e3


def rank_main(rank: int, world_size: int, store: str, case_name: str, repeats: int, answer) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    case = case_of(case_name)
    data = batches(case)
    ms = median_ms(lambda: ddp_job(case, data, rank, world_size), repeats, before=dist.barrier)
    if rank == 0:
        answer.put(ms)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="mlp")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    case = case_of(args.case)
    data = batches(case)
    local = median_ms(lambda: accumulate(case, data, args.world_size), args.repeats)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("fork")  # a fresh process with nothing but torch and the case: forking is safe
    answer = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        ranks = [context.Process(target=rank_main, args=(rank, args.world_size, os.path.join(folder, "store"),
                                                         args.case, args.repeats, answer))
                 for rank in range(args.world_size)]
        for process in ranks:
            process.start()
        ddp = answer.get(timeout=600)
        for process in ranks:
            process.join()
    print(json.dumps({"ddp_ms": ddp, "accumulate_ms": local}))


if __name__ == "__main__":
    main()
