"""The README's Frameworks table: each framework configuration the tests check, with its verdict, its
margin (greatest error / allowed error) and the median wall time of the whole check (reference run
twice, the framework's run, the comparison) over a few repeats in this process.

The rows are the test modules' own loops and cases (tests/test_lightning.py, test_accelerate.py,
test_hf_trainer.py), so the figures are of exactly what `make test-frameworks` checks.
Run: `HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_frameworks.py` (after `make test-frameworks`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import equivcheck as ec  # noqa: E402
import test_accelerate as acc  # noqa: E402
import test_hf_trainer as hf  # noqa: E402
import test_lightning as pl  # noqa: E402
from equivcheck.frameworks import lightning_loop, trainer_loop  # noqa: E402
from framework_references import CLIP, clipped_full_batch  # noqa: E402
from timing import median_seconds  # noqa: E402


def lightning_bug(model):
    return pl.Classifier(model, divide_by=4)


def rows():
    """(framework, configuration, the check to run)."""
    lightning = f"pytorch-lightning {version('pytorch-lightning')}"
    for k in (2, 4):
        yield lightning, f"accumulate_grad_batches={k}", lambda k=k: ec.check_loop(
            "mlp", lightning_loop(pl.Classifier, accumulate_grad_batches=k))
        yield lightning, f"accumulate_grad_batches={k}, gradient_clip_val={CLIP}", lambda k=k: ec.check_loop(
            "mlp", lightning_loop(pl.Classifier, accumulate_grad_batches=k, gradient_clip_val=CLIP),
            reference=clipped_full_batch)
    yield lightning, "accumulate_grad_batches=4, precision=bf16-mixed", lambda: pl.check_bf16(pl.Classifier, 4)
    yield lightning, "bug: module divides the loss by K=4 again", lambda: ec.check_loop(
        "mlp", lightning_loop(lightning_bug, accumulate_grad_batches=4))
    yield lightning, "bug: K=5, uneven micro-batches (3,3,2,2,2), mean / K", lambda: ec.check_loop(
        "mlp", lightning_loop(pl.Classifier, accumulate_grad_batches=5))
    accelerate = f"accelerate {version('accelerate')}"
    for k in (3, 4):
        yield accelerate, f"gradient_accumulation_steps={k}", lambda k=k: ec.check_loop("mlp", acc.accelerate_loop(k))
    yield accelerate, f"K=4, clip_grad_norm_({CLIP}) on sync steps", lambda: ec.check_loop(
        "mlp", acc.accelerate_loop(4, clip=CLIP), reference=clipped_full_batch)
    yield accelerate, "bug: K=5 over micro-batches of 3 (does not tile 12)", lambda: ec.check_loop(
        "mlp", acc.accelerate_loop(5, micro_batch_size=3))
    yield accelerate, f"bug: K=4, clip_grad_norm_({CLIP}) every micro-batch", lambda: ec.check_loop(
        "mlp", acc.accelerate_loop(4, clip=CLIP, clip_every_micro_batch=True), reference=clipped_full_batch)
    transformers = f"transformers {version('transformers')}"
    for k in (2, 4):
        yield transformers, f"gradient_accumulation_steps={k}, num_items_in_batch", lambda k=k: ec.check_loop(
            hf.CASE, trainer_loop(gradient_accumulation_steps=k))
    yield transformers, "bug: K=4, per-micro-batch mean / K", lambda: ec.check_loop(
        hf.bug_case(), trainer_loop(gradient_accumulation_steps=4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the frameworks' banners; verdicts come from the reports
    print(f"torch {version('torch')}; median of {args.repeats} checks after one warm-up\n")
    print("| framework | configuration | verdict | margin | time |")
    print("|---|---|---|---|---|")
    for framework, configuration, check in rows():
        (outcome,) = check().outcomes
        seconds = median_seconds(check, args.repeats)
        print(f"| {framework} | {configuration} | {outcome.verdict.value} | {outcome.comparison.margin:.1e} "
              f"| {seconds:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
