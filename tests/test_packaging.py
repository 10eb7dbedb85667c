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
    assert re.fullmatch(r"naive_scaling_uneven_chunks +ok \S+ +caught \S+", matrix), matrix


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
