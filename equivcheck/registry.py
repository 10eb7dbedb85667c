"""The case registry: built-in cases (the ``equivcheck_cases`` package) and the user's own."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .case import Case
from .errors import InvalidArgument
from .process.import_paths import (FILE_MODULE_PREFIX, SOURCE_ATTRIBUTE, bound_path, import_file, is_bound_path,
                                   resolve)

BUILTIN_PACKAGE = "equivcheck_cases"
_cases: dict[str, Case] = {}
_sources: dict[str, tuple[str, str | None]] = {}  # case name -> (module name, file) it was registered from
_registered_by_a_call: set[str] = set()  # cases registered outside their module's import (inside a test, say)
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
    caller = sys._getframe(1).f_globals
    _sources[built.name] = (caller.get("__name__", ""), caller.get(SOURCE_ATTRIBUTE) or caller.get("__file__"))
    if _importing(caller):
        _registered_by_a_call.discard(built.name)
    else:
        _registered_by_a_call.add(built.name)
    return case


def _importing(module_globals: dict) -> bool:
    """Whether the module of ``module_globals`` is running its top level now (its import, a script's run): a
    registration made there is made again wherever the module is imported, one made by a later call is not."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is module_globals:
            return True
        frame = frame.f_back
    return False


def registered_on_import(case: Case) -> bool:
    """Whether a fresh process that imports the source of the registered ``case`` (:func:`importable_source`)
    registers it too: registered by its module's top level (or a function that top level calls), not by a call made
    later, such as a test's."""
    return case.name not in _registered_by_a_call


def case_source(name: str) -> str:
    """Where another process can import the registered case ``name`` from: a module name or a file.

    Worker processes import cases themselves (only names cross the process boundary), so a case
    must be registered at the top level of a module or file, not built inside a function.
    """
    _load_builtins()
    module, file = _sources.get(name, ("", None))
    if name not in _cases or (module in ("", "__main__") and file is None):
        raise InvalidArgument(
            f"case={name!r} is not allowed here: worker processes import cases themselves, so expected a case "
            "registered with equivcheck.register_case at the top level of an importable module or .py file"
        )
    importable = module not in ("__main__", "__mp_main__") and not module.startswith(FILE_MODULE_PREFIX)
    return module if importable and importlib.util.find_spec(module) is not None else str(file)

def importable_source(case: Case) -> str:
    """Where another process (a rank, a clean child) imports ``case`` from: the source of the case registered under its
    name by its module's top level; else ``module:NAME`` where the case itself is bound at the top level of a module or
    of the script being run (the README's ``CASE = ec.Case(...)``), the module that built it first."""
    if all_cases().get(case.name) is case and registered_on_import(case):
        return case_source(case.name)
    built = getattr(case, "built_at", None)
    bound = bound_path(case, "case", home=built[0] if built and built[2] == "<module>" else None)
    if bound is not None:
        return bound
    if all_cases().get(case.name) is not case:
        raise InvalidArgument(
            f"case={case.name!r} is not allowed here: worker processes import the case by the name it is bound to at "
            "the top level of a module or of the script being run (registered with equivcheck.register_case or "
            f"not), and this one is bound to none{_built_where(case)}. Bind it at a module's top level and check it "
            f"from there:\n    CASE = ec.Case(name={case.name!r}, ...)  # at the top level of the module\n"
            "    equivcheck.check_step(CASE, train_step, world_size=2)  # in a test, or under "
            "`if __name__ == \"__main__\":`"
        )
    return case_source(case.name)


def _built_where(case: Case) -> str:
    """``: it was built inside make_case() at tests/test_x.py:12`` where the case was built inside a function."""
    built = getattr(case, "built_at", None)
    if built is None or built[2] == "<module>":
        return ""
    file, line, function = built
    return f": it was built inside {function}() at {file}:{line}"


def load_case(name: str, source: str) -> Case:
    """The case ``name`` as :func:`importable_source` said to find it: the object at ``module:NAME``, or the case
    registered under that name once its module is imported."""
    if not is_bound_path(source):
        load_cases_from(source)
        return get_case(name)
    case = resolve(source)
    if not isinstance(case, Case) or case.name != name:
        raise InvalidArgument(f"case={name!r} is not allowed here: {source} holds {case!r} in this process, not the "
                              "case of that name (is it rebound at the module's top level after the case?)")
    return case


def all_cases() -> dict[str, Case]:
    """Every registered case, built-in ones first, by name."""
    _load_builtins()
    return dict(_cases)


def builtin_cases() -> dict[str, Case]:
    """The cases that ship with equivcheck (the ``equivcheck_cases`` package), by name; not the field's (a field
    module registers its cases when ``equivcheck field`` imports it: they belong to its report, not to the matrix)."""
    return {name: case for name, case in all_cases().items()
            if _sources[name][0].partition(".")[0] == BUILTIN_PACKAGE
            and not _sources[name][0].startswith(f"{BUILTIN_PACKAGE}.field.")}


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
    """Import a module by name or a Python file by path, so that its ``register_case`` calls run.

    A source that cannot be imported (a syntax error, an exception, a missing package) is a usage
    error naming the file and line, ``cases.py:3: ZeroDivisionError: division by zero``. So is one that
    exits while it is imported (a script's ``sys.exit(main())`` outside its main guard, argparse's
    ``--help``) or raises KeyboardInterrupt: a gate whose cases never registered has checked nothing."""
    try:
        _import_source(source)
    except InvalidArgument:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:
        raise InvalidArgument(f"cases_from={source!r} could not be imported: {_where(error)}") from error


_STANDARD_LIBRARY = sysconfig.get_paths()["stdlib"] + os.sep


def _where(error: BaseException) -> str:
    """``file:line: Type: message`` for the innermost frame of the failure (a syntax error's own place)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}: {type(error).__name__}: {error.msg}"
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and f.filename != __file__] or frames
    if isinstance(error, SystemExit):  # the user's line that exits, not argparse's own exit inside the standard library
        user = [f for f in user if not f.filename.startswith(_STANDARD_LIBRARY)] or user
    place = f"{user[-1].filename}:{user[-1].lineno}: " if user else ""
    if isinstance(error, SystemExit):
        return (f"{place}SystemExit({error.code!r}): the module exits while it is imported (a script's "
                "sys.exit(...) outside `if __name__ == \"__main__\":`?), so no case it defines was registered")
    return f"{place}{type(error).__name__}: {error}"


def _import_source(source: str) -> None:
    path = Path(source)
    if source.endswith(".py") or path.is_file():
        if not path.is_file():
            raise InvalidArgument.value("cases_from", source, "an existing .py file or an importable module name")
        import_file(source)
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
