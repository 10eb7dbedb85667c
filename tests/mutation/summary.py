"""The kill rate of the last `make mutation` run, per module and in all, read from mutmut's own records
(mutants/**/*.meta). A mutant counts as killed when a test failed on it or it ran past its time limit;
every other one (survived, reached by no test, crashed, suspicious, skipped) counts against the rate, as in
mutmut's own score.

    python tests/mutation/summary.py [--survivors]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import Counter

from mutmut.stats import status_by_exit_code as status  # the meaning of each exit code, as mutmut reads them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutants", default="mutants", help="mutmut's folder")
    parser.add_argument("--survivors", action="store_true", help="name every mutant that was not killed")
    args = parser.parse_args()
    rows, total, left = [], Counter(), []
    for meta in sorted(glob.glob(os.path.join(args.mutants, "**", "*.py.meta"), recursive=True)):
        with open(meta) as file:
            codes = json.load(file)["exit_code_by_key"]
        if not codes:
            continue
        counts = Counter(status[code] for code in codes.values())
        rows.append((os.path.relpath(meta, args.mutants)[: -len(".meta")], counts))
        total += counts
        left += sorted(name for name, code in codes.items() if status[code] not in ("killed", "timeout"))
    print(f"{'module':<34} {'mutants':>7} {'killed':>7} {'timeout':>7} {'survived':>8} {'no tests':>8} {'rate':>6}")
    for module, counts in rows + [("all", total)]:
        n = sum(counts.values())
        caught = counts["killed"] + counts["timeout"]
        print(f"{module:<34} {n:>7} {counts['killed']:>7} {counts['timeout']:>7} {counts['survived']:>8} "
              f"{counts['no tests']:>8} {caught / n:>6.1%}")
    if args.survivors:
        print("\nnot killed:", *left, sep="\n  ")


if __name__ == "__main__":
    main()
