"""The case registry: built-in cases (the ``equivcheck_cases`` package) and the user's own."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .case import Case
from .errors import InvalidArgument

BUILTIN_PACKAGE = "equivcheck_cases"
_cases: dict[str, Case] = {}
_builtins_loaded = False

T = TypeVar("T", Case, Callable[[], Case])


def register_case(case: T) -> T:
    """Register a Case; also a decorator on a function returning one. Returns its argument."""
    built = case() if callable(case) and not isinstance(case, Case) else case
    if not isinstance(built, Case):
        raise InvalidArgument.type("case", built, "an equivcheck.Case (or a function returning one)")
    existing = _cases.get(built.name)
    if existing is not None and existing is not built:
        raise InvalidArgument.value("name", built.name, "a case name not registered yet")
    _cases[built.name] = built
    return case


def all_cases() -> dict[str, Case]:
    """Every registered case, built-in ones first, by name."""
    _load_builtins()
    return dict(_cases)


def get_case(name: str) -> Case:
    cases = all_cases()
    if name not in cases:
        raise InvalidArgument.unknown("case", name, cases)
    return cases[name]


def resolve_case(case: Case | str) -> Case:
    if isinstance(case, Case):
        return case
    if isinstance(case, str):
        return get_case(case)
    raise InvalidArgument.type("case", case, "an equivcheck.Case or a registered case name")


def load_cases_from(source: str) -> None:
    """Import a module by name or a Python file by path, so that its ``register_case`` calls run."""
    path = Path(source)
    if source.endswith(".py") or path.is_file():
        if not path.is_file():
            raise InvalidArgument.value("cases_from", source, "an existing .py file or an importable module name")
        module_name = f"equivcheck_user_cases_{abs(hash(str(path.resolve())))}"
        if module_name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return
    try:
        importlib.import_module(source)
    except ModuleNotFoundError as error:
        if error.name and source.startswith(error.name):
            raise InvalidArgument.value("cases_from", source, "an existing .py file or an importable module name") from None
        raise


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module(BUILTIN_PACKAGE)
