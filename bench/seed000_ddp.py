"""Seed 000's matrix: gradient accumulation over the head only, on 2 DDP ranks (the ``seed000_ddp`` case).

Per regime: the verdict, the margin, the gradient all-reduces of each step, the peak activation memory
of one rank beside plain DDP's, then what equivcheck said of each regime that is not equivalent.
"""

from __future__ import annotations

import equivcheck as ec
from equivcheck.report import render_columns
from equivcheck.savings import format_bytes

CASE = "seed000_ddp"
PLAIN = "ddp:world_size=2"


def main() -> None:
    report = ec.check(CASE)
    plain = report.outcome(CASE, PLAIN).result.peak_activation_bytes
    table = [["regime", "verdict", "margin", "all-reduces per step", "peak activation (rank 0)", "vs plain DDP"]]
    said = []
    for o in report.outcomes:
        result, c = o.result, o.comparison
        peak = result.peak_activation_bytes if result else None
        table.append([
            o.regime, o.verdict.value, "-" if c is None else f"{c.margin:.1e}",
            "-" if result is None or result.syncs is None else " ".join(map(str, result.syncs)),
            "-" if peak is None else format_bytes(peak),
            "-" if peak is None or result.syncs is None else f"{peak / plain:.2f}x",
        ])
        if c is not None and not c.ok:
            said.append(f"{o.regime}:\n  " + "\n  ".join(filter(None, [c.hint, *c.problems])))
        elif o.reason:
            said.append(f"{o.regime}: {o.reason}")
    print(render_columns(table))
    print()
    print("\n".join(said))


if __name__ == "__main__":
    main()
