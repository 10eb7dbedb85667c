"""Repository-wide pytest settings: hypothesis profiles (pick one with --hypothesis-profile), pytester, the sample
`make test` runs of what `make test-full` runs whole (--full), and what `make mutation` needs to see the DDP ranks."""

import glob
import json
import os
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]  # the plugin's own tests run pytest inside pytest

# ci: derandomized and bounded for a 2-core machine; dev: more examples when hunting.
settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile("ci")


# make test keeps under 10 minutes on 2 cores by sampling its longest runs; make test-full (--full) runs them whole.
# A test marked `full_only` runs with --full alone (a row the sample leaves out, a second layout of the same run); a
# test marked `sampled` runs in both and asks `whole` how much (the catalogue compared as it trains, the DDP fuzz).
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run whole what make test samples (the tests marked full_only or sampled: make test-full)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full_only: left out of make test's sample, run by make test-full (--full)")
    config.addinivalue_line("markers", "sampled: make test runs a sample of it, make test-full (--full) all of it")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    left_out = [item for item in items if item.get_closest_marker("full_only")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("full_only")]
        config.stash[LEFT_OUT] = len(left_out)


LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} tests left to make test-full (--full), and the sampled ones run "
                                    "whole there")


@pytest.fixture(scope="session")
def whole(request) -> bool:
    """Whether this run checks whole what make test samples (--full)."""
    return request.config.getoption("--full")



@pytest.fixture(scope="session", autouse=True)
def verdicts_without_locations():
    """Most tests assert verdicts alone: their failed checks skip the replays that say where a run parts (about a
    training each). The tests of the localizer, the catalogue's and the field's locations and the reports that print
    them turn it back on (``locating``); a command or a pytest run started by a test locates, as users get it."""
    import equivcheck  # noqa: F401 (its module ``check``, whose name the package gives the function)

    sys.modules["equivcheck.check"].LOCATE_BY_DEFAULT = False
    yield


@pytest.fixture
def locating(monkeypatch):
    """This test's failed checks say where their runs part (``ec.check``'s default, as users get it)."""
    import equivcheck  # noqa: F401

    monkeypatch.setattr(sys.modules["equivcheck.check"], "LOCATE_BY_DEFAULT", True)


@pytest.fixture
def isolated_registry(monkeypatch):
    """User cases registered by a test leave the registry of the outer session as it was."""
    from equivcheck import registry

    registry.all_cases()  # the built-in cases are loaded once, into the registry the test leaves as it was
    monkeypatch.setattr(registry, "_cases", dict(registry._cases))
    monkeypatch.setattr(registry, "_sources", dict(registry._sources))
    monkeypatch.setattr(registry, "_registered_by_a_call", set(registry._registered_by_a_call))


# `make mutation` maps every mutant to the tests that reach its function by recording, in the test process,
# which functions each test calls. A DDP rank is a process of its own, so in that stats run every test ends by
# closing its pools: the ranks exit and write what they called (tests/mutation/sitecustomize.py, on their
# import path), which is added to the test's record before mutmut reads it. Without this, every function that
# only the ranks run would count as reached by no test, and none of its mutants would be tried.
_RANK_HITS = os.path.join(tempfile.gettempdir(), f"equivcheck-mutmut-rank-hits-{os.getpid()}")


def _in_mutation_stats_run() -> bool:
    return os.environ.get("MUTANT_UNDER_TEST") == "stats"


def pytest_runtest_setup(item):
    if _in_mutation_stats_run():
        os.makedirs(_RANK_HITS, exist_ok=True)
        os.environ["EQUIVCHECK_MUTMUT_RANK_HITS"] = _RANK_HITS
        rank_site = os.path.join(os.path.dirname(__file__), "tests", "mutation")
        if rank_site not in sys.path:
            sys.path.append(rank_site)  # the pool hands its ranks this process's import path


def pytest_runtest_teardown(item, nextitem):
    if not _in_mutation_stats_run():
        return
    from mutmut.state import state

    from equivcheck.runners.ranks import pool

    if not any(warm._jobs for warm in pool._pools.values()):
        return  # no rank trained anything in this test
    pool.shutdown_pools()
    for path in glob.glob(os.path.join(_RANK_HITS, "*.json")):
        with open(path) as hits:
            state()._stats.update(json.load(hits))
        os.remove(path)
    started = time.perf_counter()
    pool.pool_for("gloo", 2)  # warm again: a test that times its job must not time a pool's start
    # A mutant's run starts its own pools, and mutmut runs a mutant's tests fastest first: the start belongs to
    # the test's recorded time, or tests that need ranks go first and every mutant pays a pool start.
    state().duration_by_test[item.nodeid] += time.perf_counter() - started
