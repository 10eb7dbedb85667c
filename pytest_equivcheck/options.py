"""Policy: the command-line options and the marker's keywords, validated without importing torch.

Everything a user can misconfigure is checked here and raised as ``pytest.UsageError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

# equivcheck.precision.PRECISIONS by name, written out so that loading the plugin imports no torch.
DTYPES = ("float64", "float32", "bf16-autocast", "fp16-autocast", "float64-shadow")
# The keywords @pytest.mark.equivcheck(...) accepts: per-test defaults for the fixture's checks.
MARKER_KEYWORDS = ("reference", "rtol", "atol", "seed", "dtype", "timeout")
MARKER_HELP = (
    "equivcheck(reference=SPEC, rtol=R, atol=A, seed=N, dtype='float64'|'float32'|'bf16-autocast'|'fp16-autocast', timeout=SECONDS): "
    "defaults for the equivcheck fixture's checks in this test"
)


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("equivcheck", "equivalence of training regimes (equivcheck)")
    group.addoption("--equivcheck-cases", action="append", default=[], metavar="NAME",
                    help="generate one test per (case, regime) for this case; 'all' for every registered case "
                         "(repeatable)")
    group.addoption("--equivcheck-regimes", action="append", default=[], metavar="SPEC",
                    help="regime spec for the generated tests, e.g. accumulate:chunks=4 (repeatable; "
                         "default: each case's own list; alone, it generates tests for every case)")
    group.addoption("--equivcheck-cases-from", action="append", default=[], metavar="FILE_OR_MODULE",
                    help="import a .py file or module that registers cases (repeatable)")
    group.addoption("--equivcheck-dtype", choices=DTYPES, default=None,
                    help="train every case in this precision mode (default: each case's own dtype)")
    group.addoption("--equivcheck-seed", type=int, default=None, metavar="N", help="seed of every check (default: 0)")
    group.addoption("--equivcheck-rtol", type=float, default=None, metavar="R",
                    help="relative tolerance of every check (with --equivcheck-atol)")
    group.addoption("--equivcheck-atol", type=float, default=None, metavar="A",
                    help="absolute tolerance of every check (with --equivcheck-rtol)")
    group.addoption("--equivcheck-timeout", type=float, default=None, metavar="SECONDS",
                    help="fail an in-process check, or a distributed job on the worker pool, that runs longer "
                         "than this")
    group.addoption("--equivcheck-json", default=None, metavar="PATH",
                    help="write the outcomes of every check as JSON rows (the CLI's format) to PATH")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The session's options, as the checks use them."""

    cases: tuple[str, ...]
    regimes: tuple[str, ...]
    cases_from: tuple[str, ...]
    dtype: str | None
    seed: int | None
    rtol: float | None
    atol: float | None
    timeout: float | None
    json: str | None

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        option = lambda name: config.getoption(f"--equivcheck-{name}")  # noqa: E731
        settings = cls(
            cases=tuple(option("cases")), regimes=tuple(option("regimes")), cases_from=tuple(option("cases-from")),
            dtype=option("dtype"), seed=option("seed"), rtol=option("rtol"), atol=option("atol"),
            timeout=option("timeout"), json=option("json"),
        )
        settings.validate("--equivcheck-")
        return settings

    @property
    def generate(self) -> bool:
        """Tests per (case, regime) are opt-in: asked for by naming cases or regimes."""
        return bool(self.cases or self.regimes)

    def defaults(self) -> dict[str, object]:
        """The keyword defaults a check takes from the command line (None: not given)."""
        return {"seed": self.seed, "rtol": self.rtol, "atol": self.atol, "dtype": self.dtype, "timeout": self.timeout}

    def validate(self, prefix: str) -> None:
        validate_values(self.defaults(), prefix)


def validate_values(values: Mapping[str, object], prefix: str) -> None:
    """Check option or marker values; ``prefix`` names them as the user wrote them."""
    def fail(name: str, allowed: str) -> None:
        raise pytest.UsageError(f"{prefix}{name}={values[name]!r} is not allowed: expected {allowed}")

    if ("rtol" in values or "atol" in values) and (values.get("rtol") is None) != (values.get("atol") is None):
        fail("rtol" if values.get("rtol") is not None else "atol", "rtol and atol given together")
    for name in ("rtol", "atol"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
            fail(name, "a number >= 0")
    timeout = values.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        fail("timeout", "a number of seconds > 0")
    seed = values.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        fail("seed", "an integer >= 0")
    dtype = values.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        fail("dtype", " or ".join(repr(d) for d in DTYPES))
    reference = values.get("reference")
    if reference is not None and not isinstance(reference, str) and not callable(reference):
        fail("reference", "a regime spec str or a step function")


def marker_values(item: pytest.Item) -> dict[str, object]:
    """The equivcheck marker keywords that apply to ``item``, the closest marker winning; checked."""
    values: dict[str, object] = {}
    for mark in reversed(list(item.iter_markers("equivcheck"))):
        if mark.args:
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.equivcheck takes keywords only, got positional {mark.args!r}; "
                f"allowed keywords: {', '.join(MARKER_KEYWORDS)}"
            )
        unknown = sorted(set(mark.kwargs) - set(MARKER_KEYWORDS))
        if unknown:
            raise pytest.UsageError(
                f"{item.nodeid}: unknown @pytest.mark.equivcheck keyword {unknown[0]!r}; "
                f"allowed keywords: {', '.join(MARKER_KEYWORDS)}"
            )
        values.update(mark.kwargs)
    validate_values(values, f"{item.nodeid}: @pytest.mark.equivcheck ")
    return values
