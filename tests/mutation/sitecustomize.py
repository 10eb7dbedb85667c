"""Loaded by every DDP rank of a `make mutation` stats run (the conftest puts this folder on the ranks'
import path): mutmut records which functions a test reaches in the process that calls them, and a rank is a
process of its own, so at exit the rank writes what it called where the test process reads it back.
Outside a stats run this does nothing."""

import atexit
import json
import os

HITS_VARIABLE = "EQUIVCHECK_MUTMUT_RANK_HITS"


def _write_hits(folder: str) -> None:
    from mutmut.state import state

    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as out:
        json.dump(sorted(state()._stats), out)


if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get(HITS_VARIABLE):
    atexit.register(_write_hits, os.environ[HITS_VARIABLE])
