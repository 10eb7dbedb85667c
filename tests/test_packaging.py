"""The package as users install it.

Always: pyproject's package list holds every package of the source tree, and the installed
command, the README's first example and ``pytest --help`` work. Under ``make test`` (which sets
``EQUIVCHECK_DIST``), also: the wheel and the sdist hold every source file, and the suite runs
against the installed wheel, never against the checkout.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

SOURCE_TREE = Path(os.environ.get("EQUIVCHECK_SOURCE_TREE") or Path(__file__).parents[1]).resolve()
DIST = os.environ.get("EQUIVCHECK_DIST")  # the folder holding the sdist and the wheel that make test built
BIN = Path(sys.executable).parent
from_the_wheel = pytest.mark.skipif(DIST is None, reason="make test sets EQUIVCHECK_DIST when it runs the suite "
                                                          "against the built wheel")


def setuptools_config() -> dict:
    with open(SOURCE_TREE / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["tool"]["setuptools"]


def source_packages() -> dict[str, Path]:
    """Every package under each top-level package's folder, by the dotted name it installs as."""
    config = setuptools_config()
    folders = config.get("package-dir", {})
    tops = {name for name in config["packages"] if "." not in name}
    found = {}
    for top in tops:
        base = SOURCE_TREE / folders.get(top, top)
        for init in base.rglob("__init__.py"):
            found[".".join((top, *init.parent.relative_to(base).parts))] = init.parent
    return found


def source_files() -> dict[str, Path]:
    """Every file a user's install must hold: each package's modules and its package data, by install path."""
    data = setuptools_config().get("package-data", {})
    files = {}
    for name, folder in source_packages().items():
        for path in [*folder.glob("*.py"), *(folder / pattern for pattern in data.get(name, ()))]:
            files["/".join((*name.split("."), path.name))] = path
    return files


def test_pyproject_lists_every_package_of_the_source_tree():
    listed = set(setuptools_config()["packages"])
    found = set(source_packages())
    assert found - listed == set(), "packages in the source tree that the wheel would leave out"
    assert listed - found == set(), "packages listed in pyproject.toml that the source tree lacks"


@from_the_wheel
def test_the_wheel_and_the_sdist_hold_every_source_file():
    dist = Path(DIST)
    (wheel,) = dist.glob("equivcheck-*.whl")
    (sdist,) = dist.glob("equivcheck-*.tar.gz")
    expected = source_files()
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    assert sorted(set(expected) - in_wheel) == []
    with tarfile.open(sdist) as archive:
        in_sdist = {"/".join(Path(n).parts[1:]) for n in archive.getnames()}
    assert sorted(str(p.relative_to(SOURCE_TREE)) for p in expected.values()
                  if str(p.relative_to(SOURCE_TREE)) not in in_sdist) == []


@from_the_wheel
def test_the_suite_imports_the_installed_package_not_the_checkout():
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for name, folder in source_packages().items():
        location = Path(importlib.import_module(name).__file__).resolve()
        assert location.is_relative_to(site), f"{name} imported from {location}, not from {site}"
        assert location.parent != folder.resolve(), f"{name} imported from the checkout"


def run(*command: str, **options) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, **options)


def readme_first_example() -> str:
    readme = (SOURCE_TREE / "README.md").read_text()
    return readme.split("## Check your own case in a few lines\n\n```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_first_example_runs_as_written_and_its_twin_fails(tmp_path):
    example = readme_first_example()
    assert run(sys.executable, "-c", example, cwd=tmp_path).returncode == 0
    buggy = example.replace('"accumulate:chunks=5"', '"naive_accumulate:chunks=5"')
    assert buggy != example
    failed = run(sys.executable, "-c", buggy, cwd=tmp_path)
    assert failed.returncode == 1 and "NotEquivalent" in failed.stderr
    assert "my_mlp under naive_accumulate:chunks=5: mismatch" in failed.stderr


def test_the_installed_command_runs_a_ddp_regime_and_catches_a_pitfall(tmp_path):
    done = run(str(BIN / "equivcheck"), "run", "--case", "naive_scaling_uneven_chunks",
               "--regime", "ddp:world_size=2", "--regime", "naive_accumulate:chunks=5", "--matrix", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    overview, matrix, _ = [line for line in done.stdout.splitlines() if line.startswith("naive_scaling_uneven_chunks")]
    assert re.fullmatch(r"naive_scaling_uneven_chunks +1 ok, 1 caught +naive_accumulate:chunks=5 \S+", overview), overview
    assert re.fullmatch(r"naive_scaling_uneven_chunks +ok \S+ +caught \S+ loss", matrix), matrix  # and its phase


def test_pytest_help_shows_the_plugin_options(tmp_path):
    done = run(sys.executable, "-m", "pytest", "--help", cwd=tmp_path)
    assert done.returncode == 0
    assert "--equivcheck-cases" in done.stdout and "--equivcheck-timeout" in done.stdout


def test_every_relative_link_in_the_guide_and_the_docs_leads_somewhere():
    """The README is a guide that points into docs/ and bench/: a moved file must not leave it pointing nowhere."""
    pages = [SOURCE_TREE / "README.md", SOURCE_TREE / "bench" / "README.md", *sorted((SOURCE_TREE / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(SOURCE_TREE)} -> {target}")
    assert len(pages) > 5 and broken == []


# an absolute path of the machine a page was written on: a home, a temporary or a work folder
MACHINE_PATH = re.compile(r"(?<![\w.:/~-])/(?:root|home|Users|tmp|var/folders|private/var|work)/[^\s`'\")]*")


def test_no_page_of_the_guide_or_the_docs_holds_a_path_of_the_machine_it_was_written_on():
    """Output pasted from a command names files relative to the repository: a reader's checkout lives elsewhere."""
    pages = [SOURCE_TREE / "README.md", SOURCE_TREE / "bench" / "README.md", *sorted((SOURCE_TREE / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(SOURCE_TREE)}:{number}: {match.group()}"
             for page in pages for number, line in enumerate(page.read_text().splitlines(), 1)
             for match in MACHINE_PATH.finditer(line)]
    assert len(pages) > 5 and found == []


def test_docs_cli_md_lists_every_option_of_every_command():
    """The README sends readers to docs/cli.md for every option: its synopsis lists each command's options with
    their choices as the parser has them, and each option of run, catalogue, audit and field has its row."""
    import argparse

    from equivcheck.cli import build_parser

    doc = (SOURCE_TREE / "docs" / "cli.md").read_text()
    synopsis = doc.split("```\n", 2)[1]
    parts = re.split(r"^equivcheck (\w+)", synopsis, flags=re.M)
    by_command = dict(zip(parts[1::2], parts[2::2]))
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert sorted(by_command) == sorted(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            option = max(action.option_strings, key=len, default=None)
            if option is None or option == "--help":
                continue
            shown = re.search(rf"(?<=[\[ ]){option}(?: ([^\]\s]+))?(?=[\]\s])", by_command[name])
            assert shown, f"equivcheck {name} {option} is missing from docs/cli.md's synopsis"
            if action.choices is not None:
                assert shown.group(1) == "|".join(action.choices), f"equivcheck {name} {option}: its choices"
            if name != "list":
                assert re.search(rf"^\| [^|]*`{option}[ `]", doc, flags=re.M), f"equivcheck {name} {option}: no row"


LAYOUT_ROW = re.compile(r"^\| (\d+) \| `(equivcheck/[\w/]+\.py)` \| .+ \|$", re.M)


def layout_floors() -> dict[str, int]:
    """docs/extending.md's map of the code: each module of equivcheck/ by path, with its floor."""
    rows = LAYOUT_ROW.findall((SOURCE_TREE / "docs" / "extending.md").read_text())
    floors = {path: int(floor) for floor, path in rows}
    assert len(floors) == len(rows), "a module listed twice"
    return floors


def room(module: str) -> str:
    """What an import arrow joins: a module at the top of the package, or a whole package below it."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def imported_modules(path: Path, module: str, known: set[str]) -> set[str]:
    """Every module of equivcheck that ``module`` imports, at its top or inside a function."""
    import ast

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def test_docs_extending_md_maps_every_module_and_every_import_runs_down_its_floors():
    floors = layout_floors()
    modules = {path: name for path, name in ((str(p.relative_to(SOURCE_TREE)), ".".join(
        p.relative_to(SOURCE_TREE).with_suffix("").parts).removesuffix(".__init__"))
        for p in sorted((SOURCE_TREE / "equivcheck").rglob("*.py")))}
    assert sorted(set(modules) - set(floors)) == [], "modules docs/extending.md's layout does not list"
    assert sorted(set(floors) - set(modules)) == [], "modules docs/extending.md lists that the tree lacks"
    floor_of = {}
    for path, name in modules.items():
        assert floor_of.setdefault(room(name), floors[path]) == floors[path], f"{path}: not on its package's floor"
    upward = [f"{name} (floor {floor_of[room(name)]}) imports {target} (floor {floor_of[room(target)]})"
              for path, name in modules.items()
              for target in sorted(imported_modules(SOURCE_TREE / path, name, set(modules.values())))
              if room(target) != room(name) and floor_of[room(target)] >= floor_of[room(name)]]
    assert upward == []
