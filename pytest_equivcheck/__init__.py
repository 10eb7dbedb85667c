"""equivcheck's pytest plugin (registered through the ``pytest11`` entry point).

The hooks: options and marker (``options``), the ``equivcheck`` fixture (``checker``), generated tests
(``items``), deadlines (``deadline``), the rows gathered from every test and the matrix at the end
(``controller``); here the hooks that tie them together and the header line. Nothing here imports torch at
import time: ``pytest --help`` stays fast, and torch is imported only once equivcheck is used.
"""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from .controller import Controller
from .options import MARKER_HELP, Settings, add_options, marker_values

SETTINGS = pytest.StashKey[Settings]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.stash[SETTINGS] = settings = Settings.from_config(config)
    if settings.cases_from or settings.regimes:  # opted in: import equivcheck (and torch) now, to fail early
        _load(settings)
    if not hasattr(config, "workerinput"):  # xdist workers send their rows to the controller
        metadata = {"seed": settings.seed or 0, "dtype": settings.dtype, "backend": None, "world_sizes": []}
        controller = Controller(settings.json, settings.html, settings.markdown, metadata, settings.plots)
        config.pluginmanager.register(controller, "equivcheck-controller")


def _load(settings: Settings) -> None:
    """Register the cases of --equivcheck-cases-from and check --equivcheck-regimes; mistakes are usage errors."""
    import equivcheck as ec

    try:
        for source in settings.cases_from:
            ec.load_cases_from(source)
        for spec in settings.regimes:
            ec.parse_regime(spec)
    except ec.InvalidArgument as error:
        raise pytest.UsageError(f"equivcheck: {error}") from None


def pytest_report_header(config: pytest.Config) -> str:
    from equivcheck.device import DEFAULT_DEVICE, auto_backend

    settings = config.stash[SETTINGS]
    seed = settings.seed if settings.seed is not None else 0
    if settings.generate:
        import equivcheck as ec

        from .items import planned

        sizes = sorted({ec.parse_regime(spec).world_size for _, spec in planned(settings)})
        world_sizes = ",".join(map(str, sizes)) + " (generated tests)"
    else:
        world_sizes = "per test"
    device = settings.device or DEFAULT_DEVICE
    return (f"equivcheck: seed {seed}, torch {metadata.version('torch')}, device {device}, "
            f"backend {auto_backend(device)}, dtype {settings.dtype or 'per case'}, world sizes {world_sizes}")


USAGE_ERROR = "equivcheck_usage_error"  # what an xdist worker met at collection, for the controller to raise
WORKER_USAGE_ERROR = pytest.StashKey[str]()  # in the controller: what a worker handed over


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect, so they select generated tests too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        for item in items:
            marker_values(item)  # a misspelt keyword stops the run before anything trains
        settings = config.stash[SETTINGS]
        if settings.generate:
            from .items import generate

            items.extend(generate(session, settings))
    except pytest.UsageError as error:
        if not hasattr(config, "workerinput"):
            raise
        # An xdist worker that raised would crash its node: it runs nothing and hands the error to the controller,
        # which ends the session with it, as a serial run does.
        config.workeroutput[USAGE_ERROR] = str(error)
        items.clear()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    message = getattr(node, "workeroutput", {}).get(USAGE_ERROR)
    if message:
        node.config.stash[WORKER_USAGE_ERROR] = message


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    message = session.config.stash.get(WORKER_USAGE_ERROR, None)
    if message:
        sys.stderr.write(f"ERROR: {message}\n")
        session.exitstatus = pytest.ExitCode.USAGE_ERROR


@pytest.fixture
def equivcheck(request: pytest.FixtureRequest):
    """Check a case or a team's step in one call: ``equivcheck.check("mlp", "accumulate:chunks=4")`` (one spec or a
    list, as ``ec.check`` takes them), ``equivcheck.check_step(case, my_step)``. Fails the test describing every
    mismatch."""
    from .checker import Checker

    settings = request.config.stash[SETTINGS]
    return Checker(request.node, {**settings.defaults(), **marker_values(request.node)})
