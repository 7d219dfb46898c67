"""The README's promise to type checkers: its loop passes ``mypy --strict`` in a user's project.

The project sees lossweight as a user does, installed from a wheel (not editable, not the
source tree), so these tests fail if the wheel leaves out ``py.typed`` or if the public API's
types stop being complete. A cold mypy run analyses torch: about 30 s on 2 CPU cores; the
tests of this module share its cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .test_docs import ROOT, code_blocks

README = ROOT / "README.md"
# A user's misuse of lossweight, each line an error only lossweight's annotations can reveal.
MISUSE = """\
import lossweight

acc = lossweight.Accumulator(loss_reduction="average")
logged: float = acc.end().loss
"""
MISUSE_ERRORS = [
    'misuse.py:3: error: Argument "loss_reduction" to "Accumulator" has incompatible type '
    "\"Literal['average']\"",
    'misuse.py:4: error: Incompatible types in assignment (expression has type "Tensor", '
    'variable has type "float")',
]


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    subprocess.run(command, check=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: an in-tree build would write build/ and *.egg-info into the checkout.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(
        ROOT / "lossweight", source / "lossweight", ignore=shutil.ignore_patterns("__pycache__")
    )
    wheels = tmp_path_factory.mktemp("wheels")
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source))
    [built] = wheels.glob("lossweight-*.whl")
    return built


@pytest.fixture(scope="module")
def project(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's project: the README's loop as main.py, the README's mypy configuration, a
    misuse of lossweight in misuse.py, and lossweight installed from the wheel in site/."""
    root = tmp_path_factory.mktemp("project")
    site = root / "site"
    pip("install", "--no-deps", "--no-index", "--no-compile", "--target", str(site), str(wheel))
    [loop] = code_blocks(README, "python")
    [config] = code_blocks(README, "toml")
    (root / "main.py").write_text(loop)
    (root / "pyproject.toml").write_text(config)
    (root / "misuse.py").write_text(MISUSE)
    return root


def mypy(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """mypy run as in the project's own directory, with the wheel's install as the only
    lossweight in sight: site/ is on the search path as a site-packages directory, where mypy
    reads a package only if it has a ``py.typed`` marker."""
    env = {**os.environ, "PYTHONPATH": str(project / "site")}
    env.pop("MYPYPATH", None)  # it would come before site/
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(project / "cache"), *args]
    return subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_wheel_ships_the_py_typed_marker(wheel: Path) -> None:
    assert "lossweight/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_the_readme_loop_passes_mypy_strict_against_the_installed_wheel(project: Path) -> None:
    checked = mypy(project, "--verbose", "main.py")
    assert checked.returncode == 0, checked.stdout
    assert checked.stdout.startswith("Success: no issues found in 1 source file"), checked.stdout
    # --verbose logs the file of every module it reads: lossweight's are the wheel's.
    assert str(project / "site" / "lossweight" / "__init__.py") in checked.stderr
    assert str(ROOT / "lossweight") not in checked.stderr


def test_mypy_reports_a_misuse_of_lossweight_by_its_types(project: Path) -> None:
    checked = mypy(project, "main.py", "misuse.py")
    assert checked.returncode == 1, checked.stdout
    for error in MISUSE_ERRORS:
        assert error in checked.stdout, checked.stdout
    assert "Found 2 errors in 1 file (checked 2 source files)" in checked.stdout, checked.stdout
