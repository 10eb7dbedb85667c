"""How a team's code travels to worker ranks: by import path, which every rank resolves to the same object.

A function (or any object: a ``functools.partial``, a step a factory made) is found by the name it is bound to at
the top level of its module, ``module:name``. One defined in the script being run (``python check_fsdp.py``) is
found the way ``multiprocessing``'s spawn finds it: each rank imports that script under another name, so its
``if __name__ == "__main__":`` part never runs there; the path is then ``/abs/check_fsdp.py:name``. A check called
from the script's top level outside that guard would run again in every rank, so it is refused before anything
runs.
"""

from __future__ import annotations

import ast
import hashlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, ModuleType

from ..errors import InvalidArgument

SCRIPT_SUFFIX = ".py"
# The start of every ``python -c`` command equivcheck runs: ``-c`` puts the working directory first on the import path,
# and a file lying there (an ``opt_einsum.py``, which torch imports where it finds one) would run in the helper.
WITHOUT_WORKING_DIRECTORY = "import sys; del sys.path[0]; "
FILE_MODULE_PREFIX = "equivcheck_user_cases_"  # the names files imported by path are given
SOURCE_ATTRIBUTE = "__equivcheck_source__"  # set on modules loaded from a file path: the file they came from


def search_path() -> list[str]:
    """This process's module search path, so that a process it starts (the forker, its ranks, a kernel probe) imports
    modules where this one does."""
    return [p or os.getcwd() for p in sys.path]


def import_path(fn: Callable, argument: str = "step") -> str:
    """``module:name`` (or ``script.py:name``) under which ``fn`` imports back to ``fn`` in another process."""
    for module in _modules_of(fn):
        name = _bound_name(vars(module), fn)
        if name is not None:
            return f"{module.__name__}:{name}"
    script = _script_path(fn, argument)
    if script is not None:
        return script
    raise InvalidArgument.value(
        argument, fn, "a function, or an object bound to a name, at the top level of an importable module or of the "
        f"script being run (worker processes import the {argument} by name to run it on every rank); what a factory "
        "returns, or a functools.partial, qualifies once bound to a name there (`fast_step = make_step(chunks=4)`)")


def bound_path(value: object, argument: str = "case", home: str | None = None) -> str | None:
    """``module:name`` (or ``/abs/script.py:name``) where ``value`` itself is bound at the top level of a module another
    process imports, found by identity (a case defined there, registered or not); the module of the file ``home`` (where
    it was defined) is searched first, then the modules on the call stack, then every imported one. None where it is
    bound nowhere (built inside a function)."""
    main = sys.modules.get("__main__")
    for module in _modules_on_the_stack_then_all(home):
        if module is main or module.__name__ == "__mp_main__":
            continue
        name = _bound_name(vars(module), value)
        where = _importable_as(module) if name is not None else None
        if where is not None:
            return f"{where}:{name}"
    return _script_path(value, argument)


def is_bound_path(source: str) -> bool:
    """Whether ``source`` names an object (``module:name``, ``script.py:name``), not a module or file to import."""
    module, colon, name = source.rpartition(":")
    return bool(colon and module) and all(part.isidentifier() for part in name.split("."))


def _modules_on_the_stack_then_all(home: str | None = None) -> Iterator[ModuleType]:
    """The module of the file ``home``, the modules whose code called here, innermost first (where a value is usually
    bound), then every other."""
    seen: set[int] = set()
    frame, stack = sys._getframe(1), [module for module in list(sys.modules.values())
                                      if home is not None and getattr(module, "__file__", None) == home]
    while frame is not None:
        module = sys.modules.get(frame.f_globals.get("__name__", ""))
        if module is not None and getattr(module, "__dict__", None) is frame.f_globals:
            stack.append(module)
        frame = frame.f_back
    for module in (*stack, *list(sys.modules.values())):
        if isinstance(module, ModuleType) and id(module) not in seen:
            seen.add(id(module))
            yield module


def _importable_as(module: ModuleType) -> str | None:
    """What another process imports ``module`` by: its name where a search finds it, else its file (one loaded by
    path, a test module pytest imported under a name of its own)."""
    file = getattr(module, SOURCE_ATTRIBUTE, None) or getattr(module, "__file__", None)
    if not module.__name__.startswith(FILE_MODULE_PREFIX):
        try:
            if importlib.util.find_spec(module.__name__) is not None:
                return module.__name__
        except (ImportError, ValueError):
            pass
    return os.path.abspath(file) if isinstance(file, str) and file.endswith(SCRIPT_SUFFIX) else None


def resolve(path: str) -> Callable:
    """The object at ``path``: a module's (imported) or a script's (imported under its own name, not __main__)."""
    module, _, qualname = path.rpartition(":")
    found = import_file(module) if module.endswith(SCRIPT_SUFFIX) else importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _modules_of(fn: Callable) -> list[ModuleType]:
    """The importable modules ``fn`` may be bound in: its own, or, for a partial, its function's."""
    names = [getattr(fn, "__module__", None)]
    if isinstance(fn, functools.partial):
        names.append(getattr(fn.func, "__module__", None))
    modules = []
    for name in dict.fromkeys(names):
        if isinstance(name, str) and name not in ("__main__", "__mp_main__"):
            try:
                modules.append(importlib.import_module(name))
            except ImportError:
                continue
    return modules


def _bound_name(namespace: dict, fn: Callable) -> str | None:
    """The name ``fn`` is bound to in ``namespace``: its own qualified name where that resolves to it (a class's
    method included), else any top-level name bound to this very object (found by identity, as cloudpickle does)."""
    qualname = getattr(fn, "__qualname__", "")
    if qualname and "<" not in qualname:
        found: object = namespace
        for part in qualname.split("."):
            found = found.get(part) if isinstance(found, dict) else getattr(found, part, None)
        if found is fn:
            return qualname
    return next((name for name, value in namespace.items() if value is fn and not name.startswith("__")), None)


def _script_path(fn: Callable, argument: str) -> str | None:
    """``/abs/script.py:name`` where ``fn`` is bound at the top level of the script being run, and the check is called
    under its ``if __name__ == "__main__":`` guard; None where ``fn`` is not the script's."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if main is None or not file or not file.endswith(SCRIPT_SUFFIX):
        return None
    name = _bound_name(vars(main), fn)
    if name is None:
        return None
    frame = _script_frame(main)
    if frame is not None and not _under_main_guard(file, frame.f_lineno):
        raise InvalidArgument(
            f"{argument}={fn!r} is not allowed here: it is defined in the script being run ({file}), which every worker "
            f"rank imports to find it, and this check is called at line {frame.f_lineno}, outside "
            "`if __name__ == \"__main__\":`: it would run again in every rank. Move the call under that guard")
    return f"{os.path.abspath(file)}:{name}"


def _script_frame(main: ModuleType) -> FrameType | None:
    """The frame running the script's own top level (the line that led here), if the script is running."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            return frame
        frame = frame.f_back
    return None


def _under_main_guard(file: str, line: int) -> bool:
    """Whether ``line`` of ``file`` lies in a top-level ``if __name__ == "__main__":`` block."""
    try:
        with open(file, encoding="utf-8") as source:
            tree = ast.parse(source.read(), file)
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= node.end_lineno
               for node in tree.body)


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(side) for side in (test.left, test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def import_file(file: str) -> ModuleType:
    """The Python file ``file`` imported once per process under a name of its own (never ``__main__``, so a script's
    ``if __name__ == "__main__":`` part does not run): how worker ranks find cases and a team's code in it."""
    resolved = Path(file).resolve()
    module_name = FILE_MODULE_PREFIX + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(spec)
    setattr(module, SOURCE_ATTRIBUTE, str(resolved))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
