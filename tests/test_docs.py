"""The documentation's promises: its code runs, and the README's commands are the real ones."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from . import torch_range

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


# A block whose first line is "# torchrun --nproc_per_node N name.py" is a multi-process
# script, launched as that line says (with --standalone: a free port for the rendezvous).
TORCHRUN = re.compile(r"# torchrun --nproc_per_node (\d) \w+\.py\n")


# What a block that uses these needs of torch (tests/torch_range.py): skipped without it.
NEEDS = {
    "fully_shard": (torch_range.FSDP2_ON_CPU, torch_range.needs_fsdp2_on_cpu),
    "scale_grads": (torch_range.SCALE_GRADS, torch_range.needs_scale_grads),
    "torch.compile": (torch_range.COMPILED_CHECKS, torch_range.needs_compiled_checks),
}


@pytest.mark.parametrize("block", PYTHON_BLOCKS)
def test_python_block_runs_as_a_script(block: str, tmp_path: Path) -> None:
    for feature, (available, mark) in NEEDS.items():
        if feature in block and not available:
            pytest.skip(mark.kwargs["reason"])
    if "from composer" in block and importlib.util.find_spec("composer") is None:
        pytest.skip("Composer is not installed: it pins torch < 2.7.1 (see .ci/torch-range)")
    # Each block runs as its own script, as a reader would save and run it: that is also what
    # lets torch.multiprocessing re-import a block's functions in the processes it spawns.
    script = tmp_path / "example.py"
    script.write_text(block)
    torchrun = TORCHRUN.match(block)
    launch = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun[1]}"]
        if torchrun
        else []
    )
    # In a session of its own, so that a hang kills torchrun's workers too, not only torchrun.
    command = [sys.executable, *launch, str(script)]
    with subprocess.Popen(command, cwd=tmp_path, start_new_session=True) as process:
        try:
            returncode = process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert returncode == 0, f"the block exited with {returncode}"


def test_multi_process_examples_are_torchrun_scripts() -> None:
    # The code shown is what users run: torchrun, not a launcher of the docs' own.
    for page in PAGES:
        for block in code_blocks(page, "python"):
            assert "mp.spawn" not in block or "lossweight.testing" in block, page.name
            assert ("init_process_group" not in block) or TORCHRUN.match(block), page.name


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


def test_the_api_pages_show_a_docstrings_roles_as_the_code_they_name() -> None:
    # mkdocstrings renders ":class:`Term`" as written; docs/hooks.py, which mkdocs.yml runs on
    # every page, leaves the code alone.
    spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = "A :class:<code>State</code> or :meth:<code>end</code>; time: 3:func: not code"
    assert (
        hooks.on_page_content(page)
        == "A <code>State</code> or <code>end</code>; time: 3:func: not code"
    )
    assert "docs/hooks.py" in (ROOT / "mkdocs.yml").read_text()
