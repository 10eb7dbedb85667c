"""huggingface/trl#7010: trainers averaged a metric per rank before ``gather_for_metrics``, so padding stayed in.

Several trl trainers reduced a per-example metric (a reward) to this rank's batch mean and passed that scalar to
``accelerator.gather_for_metrics``. The function drops the samples the prepared dataloader repeats to even out the
ranks by slicing the gathered tensor along its batch dimension to the dataset's remainder; a gathered tensor of one
mean per rank has no such dimension left, the slice keeps every entry, and the repeated samples stay folded into
their rank's mean. The logged metric was a mean of rank means that counts the padding, where one process averages
each real example once. The fix gathers one value per example and reduces after the gather. Here 15 examples over
2 ranks in batches of 5: the last global batch holds 5 real examples on rank 0 and 5 repeated ones on rank 1, and
one process sees three equal batches, so only the rank-local mean before the gather can make the values differ.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/trl", "issue", 7010, "evaluation",
          "per-rank metric mean passed to gather_for_metrics: the padded duplicates stayed in the logged mean",
          fix_acts="metric")

PADDED_EVAL = ec.register_case(ec.Case(
    name="field_trl_padded_eval", model=ec.get_case("mlp").model,
    data=lambda: (torch.randn(15, 6), torch.randint(0, 3, (15,))),
    loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    batch_size=15, description="mlp's classifier on 15 eval examples: 2 ranks x batches of 5 pad the last global "
                               "batch"))

PER_DEVICE_EVAL_BATCH_SIZE = 5


class Accelerator:
    """Scaled down: batches dealt to the ranks in turn, the last ones padded from the dataset's start
    (even_batches); ``gather_for_metrics`` cuts the last gathered batch to ``len(dataset) % total_batch_size``,
    as accelerate does."""

    def __init__(self):
        self.use_distributed = dist.is_initialized()
        self.num_processes = dist.get_world_size() if self.use_distributed else 1
        self.process_index = dist.get_rank() if self.use_distributed else 0
        self.end_of_dataloader, self.remainder = False, -1

    def prepare(self, dataset, batch_size):
        batches = [list(range(start, min(start + batch_size, len(dataset))))
                   for start in range(0, len(dataset), batch_size)]
        padded = list(range(len(dataset))) * 2
        while len(batches) % self.num_processes or len(batches[-1]) < batch_size:
            if len(batches[-1]) < batch_size:  # fill a short batch from the start
                batches[-1] += padded[: batch_size - len(batches[-1])]
            else:  # a whole batch of repeats for the ranks left without one
                batches.append(padded[:batch_size])
        self.remainder = len(dataset) % (batch_size * self.num_processes)
        mine = [index for batch in batches[self.process_index::self.num_processes] for index in batch]
        loader = DataLoader(Subset(dataset, mine), batch_size=batch_size)
        for index, batch in enumerate(loader):
            self.end_of_dataloader = index + 1 == len(loader)
            yield batch

    def gather_for_metrics(self, tensor):
        if tensor.ndim == 0:
            tensor = tensor[None]
        if not self.use_distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor)
        tensor = torch.cat(parts)
        if self.end_of_dataloader and self.remainder > 0:
            return tensor[: self.remainder]
        return tensor


def rewards(model, x, y):
    """A per-example score, as a reward is: the log-probability of the labelled class."""
    return F.log_softmax(model(x), dim=-1).gather(1, y[:, None]).squeeze(1)


def evaluate(model, dataset, reduce_before_gather=False):
    accelerator = Accelerator()
    gathered = []
    for x, y in accelerator.prepare(dataset, PER_DEVICE_EVAL_BATCH_SIZE):
        batch_rewards = rewards(model, x, y)
        gathered.append(accelerator.gather_for_metrics(batch_rewards.mean() if reduce_before_gather else batch_rewards))
    return {"eval_rewards": torch.cat(gathered).mean()}


def evaluate_as_reported(model, dataset):
    return evaluate(model, dataset, reduce_before_gather=True)


def buggy():
    return ec.check_eval(PADDED_EVAL, evaluate_as_reported)


def fixed():
    return ec.check_eval(PADDED_EVAL, evaluate)
