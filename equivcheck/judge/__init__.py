"""Judging a run against the reference: comparison, rounding, witness, hints, the memory verdict."""
