"""What recording an evaluation's samples costs (judge/eval_location.py reads them when a metric parts): a team's
evaluation loop alone, and the same loop with every model call read back to the dataset's samples (their counts and
outputs; past its budget each output as three sums), alternated in one process; medians and the ratio.

    .venv/bin/python bench/bench_eval_location.py [--samples 8192] [--width 2048] [--classes 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from timing import alternated_seconds

from equivcheck.runners.evaluate import samples_seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, args.width), nn.ReLU(), nn.Linear(args.width, args.classes)).eval()
    data = TensorDataset(torch.randn(args.samples, 512), torch.randint(0, args.classes, (args.samples,)))

    def evaluate() -> float:
        return sum(float(F.cross_entropy(model(x), y, reduction="sum")) for x, y in DataLoader(data, batch_size=256))

    def recorded() -> None:
        with samples_seen(model, data):
            evaluate()

    with torch.no_grad():
        evaluate()
        alone, seen = alternated_seconds(evaluate, recorded, repeats=args.repeats)
    print(f"{args.samples} samples, a 512-{args.width}-{args.classes} MLP in batches of 256, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print(f"evaluate alone {alone:.3f} s, with its samples recorded {seen:.3f} s: x{seen / alone:.2f}")


if __name__ == "__main__":
    main()
