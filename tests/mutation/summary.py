"""The kill rate of the last `make mutation` run, per module and in all, read from mutmut's own records
(mutants/**/*.meta). A mutant counts as killed when a test failed on it or it ran past its time limit;
every other one tried (survived, reached by no test, crashed, suspicious, skipped) counts against the rate, as
in mutmut's own score. A mutant not tried yet (a run stopped early, or one given a sample of mutants by name)
is counted apart and left out of the rate, which is then the rate of what was tried.

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
        left += sorted(name for name, code in codes.items() if status[code] not in ("killed", "timeout", "not checked"))
    print(f"{'module':<34} {'mutants':>7} {'tried':>6} {'killed':>7} {'timeout':>7} {'survived':>8} "
          f"{'no tests':>8} {'rate':>6}")
    for module, counts in rows + [("all", total)]:
        tried = sum(counts.values()) - counts["not checked"]
        caught = counts["killed"] + counts["timeout"]
        rate = f"{caught / tried:>6.1%}" if tried else f"{'-':>6}"
        print(f"{module:<34} {sum(counts.values()):>7} {tried:>6} {counts['killed']:>7} {counts['timeout']:>7} "
              f"{counts['survived']:>8} {counts['no tests']:>8} {rate}")
    if args.survivors:
        print("\nnot killed:", *left, sep="\n  ")


if __name__ == "__main__":
    main()
