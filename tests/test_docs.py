"""The documentation's promises: its code runs, and the README's commands are the real ones."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), flags=re.M | re.S)


PYTHON_BLOCKS = [
    pytest.param(block, id=f"{page.name}-{index}")
    for page in PAGES
    for index, block in enumerate(code_blocks(page, "python"))
]


def test_every_page_has_examples() -> None:
    assert {page.name for page in PAGES} >= {"README.md", "math.md", "usage.md"}
    assert len(PYTHON_BLOCKS) >= 6


@pytest.mark.parametrize("block", PYTHON_BLOCKS)
def test_python_block_runs_as_a_script(block: str, tmp_path: Path) -> None:
    # Each block runs as its own script, as a reader would save and run it: that is also what
    # lets torch.multiprocessing re-import a block's functions in the processes it spawns.
    script = tmp_path / "example.py"
    script.write_text(block)
    subprocess.run([sys.executable, str(script)], check=True, cwd=tmp_path, timeout=300)


def test_the_readme_loop_is_the_quickstart_script() -> None:
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    assert quickstart in code_blocks(ROOT / "README.md", "python")


def readme_commands() -> list[str]:
    return [block.strip() for block in code_blocks(ROOT / "README.md", "bash")[:2]]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, tests = readme_commands()
    assert "pytest" in tests and "[test]" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_demo_command_installs_and_runs_the_demo() -> None:
    demo, _ = readme_commands()
    assert '-e ".[demo]"' in demo
    assert demo.endswith(".venv/bin/python -m lossweight.demo")
