"""huggingface/accelerate#952: ``gather_for_metrics`` dropped the whole last batch when the data divided evenly.

``gather_for_metrics`` gathers every rank's batch and, on the last batch of the eval dataloader, keeps only the first
``remainder = len(dataset) % total_batch_size`` gathered samples, cutting the ones the sampler added to even out the
ranks. When the dataset divided evenly by the total batch size the remainder was 0, and ``tensor[:0]`` kept nothing:
the last global batch vanished from the metric, which then covered ``len(dataset) - total_batch_size`` samples where
one process evaluates all of them. The fix (pull #982) truncates only when the remainder is positive and returns the
gathered batch whole otherwise. Here 16 samples over 2 ranks in batches of 4: the reported code used 8 of them.
(The samples divide evenly over the ranks, which check_eval warns is blind to padding; this bug needs exactly that.)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/accelerate", "issue", 952, "evaluation",
          "gather_for_metrics sliced the last batch to len % total_batch_size: remainder 0 dropped it all",
          fixed_by="pull #982", fix_acts="metric")

EVEN_EVAL = ec.register_case(ec.Case(
    name="field_accelerate_even_eval", model=ec.get_case("mlp").model,
    data=lambda: (torch.randn(16, 6), torch.randint(0, 3, (16,))),
    loss=lambda out, y: F.cross_entropy(out, y, reduction="none"),
    batch_size=16, description="mlp's classifier on 16 eval samples: 2 ranks x batches of 4 divide them evenly"))

BATCH_SIZE = 4


class GradientState:
    def __init__(self):
        self.end_of_dataloader = False
        self.remainder = -1


class Accelerator:
    """Scaled down: ``prepare`` deals the loader's batches to the ranks in turn; ``gather_for_metrics`` as in
    accelerate."""

    def __init__(self, truncates_only_a_positive_remainder=True):
        self.use_distributed = dist.is_initialized()
        self.num_processes = dist.get_world_size() if self.use_distributed else 1
        self.process_index = dist.get_rank() if self.use_distributed else 0
        self.gradient_state = GradientState()
        self.truncates_only_a_positive_remainder = truncates_only_a_positive_remainder

    def prepare(self, dataset, batch_size):
        """Batch k of the dataset goes to rank k % W (split_batches=False); 16 samples need no padding."""
        total_batch_size = batch_size * self.num_processes
        mine = [i for i in range(len(dataset)) if (i // batch_size) % self.num_processes == self.process_index]
        self.gradient_state.remainder = len(dataset) % total_batch_size
        loader = DataLoader(Subset(dataset, mine), batch_size=batch_size)
        for index, batch in enumerate(loader):
            self.gradient_state.end_of_dataloader = index + 1 == len(loader)
            yield batch

    def gather(self, tensor):
        if not self.use_distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def gather_for_metrics(self, tensor):
        tensor = self.gather(tensor)
        if self.use_distributed and self.gradient_state.end_of_dataloader:
            if self.gradient_state.remainder == -1:
                return tensor
            if self.gradient_state.remainder > 0 or not self.truncates_only_a_positive_remainder:
                return tensor[: self.gradient_state.remainder]  # cut the samples added to even out the ranks
        return tensor


def evaluate(model, dataset, truncates_only_a_positive_remainder=True):
    """The team's eval loop: per-sample hits and losses gathered for metrics, averaged at the end."""
    accelerator = Accelerator(truncates_only_a_positive_remainder)
    hits, losses = [], []
    for x, y in accelerator.prepare(dataset, BATCH_SIZE):
        outputs = model(x)
        hits.append(accelerator.gather_for_metrics((outputs.argmax(-1) == y).double()))
        losses.append(accelerator.gather_for_metrics(F.cross_entropy(outputs, y, reduction="none")))
    return {"accuracy": torch.cat(hits).mean(), "loss": torch.cat(losses).mean()}


def evaluate_as_reported(model, dataset):
    return evaluate(model, dataset, truncates_only_a_positive_remainder=False)


def buggy():
    return ec.check_eval(EVEN_EVAL, evaluate_as_reported)


def fixed():
    return ec.check_eval(EVEN_EVAL, evaluate)
