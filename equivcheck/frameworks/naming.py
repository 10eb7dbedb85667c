"""A framework loop's name: the configuration it checks, as the report shows it."""

from __future__ import annotations


def call_arguments(options: dict) -> str:
    """``accumulate_grad_batches=4, precision='bf16-mixed'``."""
    return ", ".join(f"{key}={value!r}" for key, value in options.items())
