"""Policy: the command-line options and the marker's keywords, validated without importing torch.

Everything a user can misconfigure is checked here and raised as ``pytest.UsageError``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

import pytest

# equivcheck.precision.PUBLIC_PRECISIONS, written out so that loading the plugin imports no torch: the modes a user
# chooses from (the float64 shadows are equivcheck's own, run beside a low-precision check, never asked for).
DTYPES = ("float64", "float32", "bf16-autocast", "fp16-autocast", "bf16", "bf16-master")
DEVICES = ("cpu", "cuda")  # equivcheck.device.DEVICES
# equivcheck.errors' bounds, written out for the same reason.
MAX_TIMEOUT = 86_400.0
MAX_SEED = 2**32 - 1
# The keywords @pytest.mark.equivcheck(...) accepts: per-test defaults for the fixture's checks.
MARKER_KEYWORDS = ("reference", "rtol", "atol", "seed", "dtype", "timeout", "threads", "isolate", "device")
MARKER_HELP = (
    f"equivcheck(reference=SPEC, rtol=R, atol=A, seed=N, dtype={'|'.join(repr(d) for d in DTYPES)}, timeout=SECONDS, "
    "threads=N, isolate=True|False, device='cpu'|'cuda'): "
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
    group.addoption("--equivcheck-device", choices=DEVICES, default=None,
                    help="where every check trains (default: cpu; cuda: ranks take a GPU each where there are enough, "
                         "else train over gloo on the CPU, the verdict saying so)")
    group.addoption("--equivcheck-seed", type=int, default=None, metavar="N", help="seed of every check (default: 0)")
    group.addoption("--equivcheck-rtol", type=float, default=None, metavar="R",
                    help="relative tolerance of every check (with --equivcheck-atol)")
    group.addoption("--equivcheck-atol", type=float, default=None, metavar="A",
                    help="absolute tolerance of every check (with --equivcheck-rtol)")
    group.addoption("--equivcheck-timeout", type=float, default=None, metavar="SECONDS",
                    help="fail an in-process check, or a distributed job on the worker pool, that makes no "
                         "progress (no step taken, nothing compiled) for this long")
    group.addoption("--equivcheck-threads", type=int, default=None, metavar="N",
                    help="torch intra-op threads per run (default: 1, unless OMP_NUM_THREADS is set)")
    group.addoption("--equivcheck-no-isolate", action="store_true", default=False,
                    help="train in the test's process, not in a forked child: a debugger's breakpoints stop, but a "
                         "run that kills its process (SIGILL, SIGSEGV) ends the session instead of failing its test")
    group.addoption("--equivcheck-json", default=None, metavar="PATH",
                    help="write the outcomes of every check as JSON rows (the CLI's format) to PATH")
    group.addoption("--equivcheck-html", default=None, metavar="PATH",
                    help="write a self-contained HTML report of every check (matrix, divergence plots) to PATH")
    group.addoption("--equivcheck-plots", choices=("failures", "all"), default="failures",
                    help="which checks the HTML report plots: those not as expected (default), or every caught pitfall "
                         "too")
    group.addoption("--equivcheck-markdown", default=None, metavar="PATH",
                    help="write a compact Markdown summary of every check to PATH (e.g. $GITHUB_STEP_SUMMARY)")


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
    threads: int | None
    json: str | None
    isolate: bool = True
    html: str | None = None
    markdown: str | None = None
    plots: str = "failures"
    device: str | None = None

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        option = lambda name: config.getoption(f"--equivcheck-{name}")  # noqa: E731
        settings = cls(
            cases=tuple(option("cases")), regimes=tuple(option("regimes")), cases_from=tuple(option("cases-from")),
            dtype=option("dtype"), seed=option("seed"), rtol=option("rtol"), atol=option("atol"),
            timeout=option("timeout"), threads=option("threads"), json=option("json"), html=option("html"),
            markdown=option("markdown"), isolate=not option("no-isolate"), plots=option("plots"),
            device=option("device"),
        )
        settings.validate("--equivcheck-")
        return settings

    @property
    def generate(self) -> bool:
        """Tests per (case, regime) are opt-in: asked for by naming cases or regimes."""
        return bool(self.cases or self.regimes)

    def defaults(self) -> dict[str, object]:
        """The keyword defaults a check takes from the command line (None: not given)."""
        return {"seed": self.seed, "rtol": self.rtol, "atol": self.atol, "dtype": self.dtype, "timeout": self.timeout,
                "threads": self.threads, "isolate": self.isolate, "device": self.device}

    def validate(self, prefix: str) -> None:
        validate_values(self.defaults(), prefix)
        for name, path in (("json", self.json), ("html", self.html), ("markdown", self.markdown)):
            folder = os.path.dirname(os.path.abspath(path)) if path else None
            if folder is not None and not os.path.isdir(folder):  # found now, not after every test has run
                raise pytest.UsageError(f"{prefix}{name}={path!r} is not allowed: expected a path in an existing folder")


def validate_values(values: Mapping[str, object], prefix: str) -> None:
    """Check option or marker values; ``prefix`` names them as the user wrote them."""
    def fail(name: str, allowed: str) -> None:
        raise pytest.UsageError(f"{prefix}{name}={values[name]!r} is not allowed: expected {allowed}")

    if ("rtol" in values or "atol" in values) and (values.get("rtol") is None) != (values.get("atol") is None):
        fail("rtol" if values.get("rtol") is not None else "atol", "rtol and atol given together")
    for name in ("rtol", "atol"):
        if not _number_within(values.get(name), 0, 1):
            fail(name, "a finite number >= 0 and <= 1")
    timeout = values.get("timeout")
    if not _number_within(timeout, 0, MAX_TIMEOUT) or timeout == 0:
        fail("timeout", f"a finite number of seconds > 0 and <= {MAX_TIMEOUT:g}")
    seed = values.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        fail("seed", f"an integer from 0 to {MAX_SEED}")
    threads = values.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        fail("threads", "an integer >= 1")
    if not isinstance(values.get("isolate", True), bool):
        fail("isolate", "True or False")
    dtype = values.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        fail("dtype", " or ".join(repr(d) for d in DTYPES))
    device = values.get("device")
    if device is not None and device not in DEVICES:
        fail("device", " or ".join(repr(d) for d in DEVICES))
    reference = values.get("reference")
    if reference is not None and not isinstance(reference, str) and not callable(reference):
        fail("reference", "a regime spec str or a step function")


def _number_within(value: object, low: float, high: float) -> bool:
    """None (not given), or a finite real number from ``low`` to ``high``."""
    if value is None:
        return True
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high


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
