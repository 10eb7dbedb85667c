"""huggingface/transformers#16865: the no_trainer examples' metrics counted the padded repeats of the last batch.

The ``run_*_no_trainer.py`` examples evaluated with a distributed dataloader that, to give every process a full
share, completes the last batch by repeating samples from the start of the dataset; they gathered every process's
predictions and labels and fed all of them to the metric. The metric therefore covered the dataset plus the
repeats, some samples counted twice, and its value differed from one process's over each sample once. The fix
counts the samples gathered so far and, on the last step, keeps only the first ``len(dataset) - samples_seen``.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import equivcheck as ec
from equivcheck.suites.field import Bug

BUG = Bug("huggingface/transformers", "pull", 16865, "evaluation",
          "eval metrics over the gathered last batch, padded repeats included", fix_acts="metric")

PER_DEVICE_EVAL_BATCH_SIZE = 4

# 11 examples over 2 processes: the loader repeats example 0 to give both 6.
EXAMPLES = ec.register_case(ec.Case(
    name="field_eval_examples", model=lambda: nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)),
    data=lambda: (torch.randn(11, 6), torch.randint(0, 3, (11,))),
    loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
    batch_size=11, description="11 labelled examples of 3 classes; evaluation pads them to 12 over 2 processes"))


def eval_dataloader_for(dataset):
    """The evaluation loader as the prepared one behaves: each process a share, the last padded by repeats."""
    sampler = DistributedSampler(dataset, shuffle=False) if dist.is_initialized() else None
    return DataLoader(dataset, batch_size=PER_DEVICE_EVAL_BATCH_SIZE, sampler=sampler)


def gather(tensor):
    """``accelerator.gather``: every process's tensor, concatenated in rank order."""
    if not dist.is_initialized():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def evaluate(model, dataset, drop_repeats=True):
    eval_dataloader = eval_dataloader_for(dataset)
    num_processes = dist.get_world_size() if dist.is_initialized() else 1
    all_predictions, all_references = [], []
    samples_seen = 0
    for step, (inputs, labels) in enumerate(eval_dataloader):
        predictions, references = gather(model(inputs).argmax(dim=-1)), gather(labels)
        if drop_repeats and num_processes > 1:  # the last batch holds the repeats
            if step == len(eval_dataloader) - 1:
                predictions = predictions[: len(eval_dataloader.dataset) - samples_seen]
                references = references[: len(eval_dataloader.dataset) - samples_seen]
            else:
                samples_seen += references.shape[0]
        all_predictions.append(predictions)  # metric.add_batch
        all_references.append(references)
    hits = torch.cat(all_predictions) == torch.cat(all_references)
    return {"accuracy": hits.double().mean()}


def evaluate_as_reported(model, dataset):
    return evaluate(model, dataset, drop_repeats=False)


def buggy():
    return ec.check_eval(EXAMPLES, evaluate_as_reported)


def fixed():
    return ec.check_eval(EXAMPLES, evaluate)
