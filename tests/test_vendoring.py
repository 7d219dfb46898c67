"""docs/vendoring.md's promise: the listed files, copied into another package, work alone."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lossweight
from benchmarks.core_size import ACCUMULATOR_FILES, COMPILED_FILES, PARALLEL_FILES

PACKAGE = Path(lossweight.__file__).parent


def run_isolated(tmp_path: Path, code: str) -> None:
    """Run ``code`` with ``tmp_path`` first on the path and the installed lossweight hidden."""
    prelude = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "sys.modules['lossweight'] = None  # an import of the installed package now fails\n"
    )
    subprocess.run([sys.executable, "-c", prelude + code], check=True, cwd=tmp_path, timeout=120)


def vendor(tmp_path: Path, files: list[str]) -> None:
    target = tmp_path / "mytrainer" / "_vendor" / "lw"
    target.mkdir(parents=True)
    for package in (tmp_path / "mytrainer", tmp_path / "mytrainer" / "_vendor", target):
        (package / "__init__.py").touch()
    for name in files:
        shutil.copy(PACKAGE / name, target / name)


def test_the_accumulator_files_run_a_step_under_another_name(tmp_path: Path) -> None:
    vendor(tmp_path, [*ACCUMULATOR_FILES, "counting.py"])  # the counting helpers' row too
    run_isolated(
        tmp_path,
        "import torch\n"
        "from mytrainer._vendor.lw.accumulator import Accumulator\n"
        "from mytrainer._vendor.lw.counting import count_tokens\n"
        "x = torch.ones((), dtype=torch.float64, requires_grad=True)\n"
        "acc = Accumulator(loss_reduction='sum')\n"
        "labels = [torch.tensor([[1, 2, -100]]), torch.tensor([[3, -100, -100]])]\n"
        "acc.begin(num_tokens=[count_tokens(y) for y in labels])\n"
        "for y in labels:\n"
        "    acc.scale_loss(x * count_tokens(y)).backward()\n"
        "result = acc.end()\n"
        "assert x.grad.item() == 1.0 and result.num_tokens.item() == 3\n",
    )


def test_the_testing_folder_added_checks_a_split_under_another_name(tmp_path: Path) -> None:
    vendor(tmp_path, list(ACCUMULATOR_FILES))
    shutil.copytree(PACKAGE / "testing", tmp_path / "mytrainer" / "_vendor" / "lw" / "testing")
    run_isolated(
        tmp_path,
        "import torch\n"
        "from mytrainer._vendor.lw.accumulator import Accumulator\n"
        "from mytrainer._vendor.lw.testing import assert_split_invariant\n"
        "model = torch.nn.Linear(2, 1).double()\n"
        "examples = [torch.full((n, 2), float(n), dtype=torch.float64) for n in (3, 1, 0, 2, 4)]\n"
        "def step(model, microbatches, collective):\n"
        "    acc = Accumulator(loss_reduction='mean', collective=collective)\n"
        "    acc.begin(num_tokens=[len(x) for x in microbatches])\n"
        "    for x in microbatches:\n"
        "        loss = model(x).square().mean() if len(x) else model(x).sum()\n"
        "        acc.scale_loss(loss).backward()\n"
        "    return acc.end()\n"
        "empty = torch.zeros(0, 2, dtype=torch.float64)\n"
        "collate = lambda batch: torch.cat(batch) if batch else empty\n"
        "assert_split_invariant(step, model, examples, collate, counts=[3, 1, 0, 2, 4])\n",
    )


def one_rank_mesh(tmp_path: Path) -> str:
    """Code that makes a one-rank gloo world and a mesh of it, ``mesh``."""
    return (
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from mytrainer._vendor.lw.accumulator import Accumulator\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/init', rank=0,\n"
        "                        world_size=1)\n"
        "mesh = init_device_mesh('cpu', (1,), mesh_dim_names=('dp',))\n"
    )


def test_the_parallel_file_added_runs_a_mesh_step_under_another_name(tmp_path: Path) -> None:
    # A one-rank gloo world and a mesh of it: the vendored parallel.py makes the mesh's group.
    vendor(tmp_path, [*ACCUMULATOR_FILES, *PARALLEL_FILES])
    run_isolated(
        tmp_path,
        one_rank_mesh(tmp_path) + "x = torch.ones((), dtype=torch.float64, requires_grad=True)\n"
        "acc = Accumulator(loss_reduction='sum', group=mesh['dp'])\n"
        "acc.begin(num_tokens=[2, 1])\n"
        "for count in (2, 1):\n"
        "    acc.scale_loss(x * count).backward()\n"
        "result = acc.end()\n"
        "assert x.grad.item() == 1.0 and result.num_tokens.item() == 3\n"
        "assert 'mytrainer._vendor.lw.parallel' in sys.modules\n"
        "dist.destroy_process_group()\n",
    )


COMPILED_STEP = (
    "import torch\n"
    "from mytrainer._vendor.lw.accumulator import Accumulator\n"
    "acc = Accumulator(loss_reduction='sum')\n"
    "layer = torch.nn.Linear(4, 1)\n"
    "def microbatch(features):\n"
    "    return acc.scale_loss(layer(features).sum())\n"
    "def step(function):\n"
    "    layer.zero_grad()\n"
    "    acc.begin(num_tokens=[3])\n"
    "    function(torch.ones(2, 4)).backward()\n"
    "    acc.end()\n"
    "    assert torch.allclose(layer.weight.grad, torch.full((1, 4), 2 / 3)), layer.weight.grad\n"
)


def raising(statement: str, kind: str, check: str, then: str = "") -> str:
    """Code that runs ``statement``, requires it to raise ``kind`` for which ``check`` (an
    expression of ``error``) holds, then runs ``then``."""
    return (
        f"try:\n    {statement}\nexcept {kind} as error:\n    assert {check}, error\n{then}"
        f"else:\n    raise AssertionError({statement!r} + ' raised nothing')\n"
    )


def test_the_compiled_file_added_compiles_scale_loss_under_another_name(tmp_path: Path) -> None:
    vendor(tmp_path, [*ACCUMULATOR_FILES, *COMPILED_FILES])
    run_isolated(
        tmp_path,
        COMPILED_STEP + "step(torch.compile(microbatch, fullgraph=True, backend='eager'))\n"
        "assert 'mytrainer._vendor.lw.compiled' in sys.modules\n",
    )


def test_a_copy_without_the_compiled_file_refuses_a_compiled_scale_loss(tmp_path: Path) -> None:
    # With fullgraph=True the compile fails with lossweight's words; without it, dynamo runs
    # scale_loss() as eager code, which weights the step as ever.
    vendor(tmp_path, list(ACCUMULATOR_FILES))
    run_isolated(
        tmp_path,
        COMPILED_STEP
        + raising(
            "step(torch.compile(microbatch, fullgraph=True, backend='eager'))",
            "Exception",
            "'needs lossweight\\'s compiled.py, which this copy of lossweight leaves out' in "
            "str(error)",
            then="    acc.abandon()\n",
        )
        + "step(torch.compile(microbatch, backend='eager'))\n",
    )


def test_an_optional_file_whose_own_import_fails_raises_that_failure(tmp_path: Path) -> None:
    # Only a file left out is refused as one: an import that fails inside compiled.py is the
    # error it is, not "this copy leaves compiled.py out".
    vendor(tmp_path, [*ACCUMULATOR_FILES, *COMPILED_FILES])
    path = tmp_path / "mytrainer" / "_vendor" / "lw" / "compiled.py"
    path.write_text(path.read_text() + "\nimport a_module_nobody_installed\n")
    run_isolated(
        tmp_path,
        raising(
            "from mytrainer._vendor.lw.accumulator import Accumulator",
            "ModuleNotFoundError",
            "error.name == 'a_module_nobody_installed'",
        ),
    )


def test_a_copy_without_the_parallel_file_refuses_a_mesh(tmp_path: Path) -> None:
    vendor(tmp_path, list(ACCUMULATOR_FILES))
    run_isolated(
        tmp_path,
        one_rank_mesh(tmp_path)
        + raising(
            "Accumulator(loss_reduction='sum', group=mesh['dp'])",
            "RuntimeError",
            "'group= a DeviceMesh needs lossweight\\'s parallel.py' in str(error)",
        )
        + "dist.destroy_process_group()\n",
    )


def test_the_accumulator_files_run_a_step_beside_torch_pipelining(tmp_path: Path) -> None:
    # torch.distributed.pipelining loaded, and no parallel.py: the core recognises torch's
    # shape-inference call by itself, and a plain step runs as ever.
    vendor(tmp_path, list(ACCUMULATOR_FILES))
    run_isolated(
        tmp_path,
        "import torch, torch.distributed.pipelining\n"
        "from mytrainer._vendor.lw.accumulator import Accumulator\n"
        "x = torch.ones((), dtype=torch.float64, requires_grad=True)\n"
        "acc = Accumulator(loss_reduction='sum')\n"
        "acc.begin(num_tokens=[2, 1])\n"
        "for count in (2, 1):\n"
        "    acc.scale_loss(x * count).backward()\n"
        "assert x.grad.item() == 1.0 and acc.end().num_tokens.item() == 3\n",
    )


def test_a_plain_step_imports_no_parallel_layout() -> None:
    code = (
        "import sys, torch, lossweight\n"
        "acc = lossweight.Accumulator(loss_reduction='sum')\n"
        "acc.begin(num_tokens=[1])\n"
        "acc.scale_loss(torch.ones((), requires_grad=True)).backward()\n"
        "acc.end()\n"
        "assert 'lossweight.parallel' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_only_the_resolver_knows_the_parallel_module() -> None:
    # The core reaches a mesh's layout through collectives.ParallelLayout alone: parallel.py,
    # and the words of meshes, appear only where a DeviceMesh given as group= is handed to it.
    found = set()
    for name in ACCUMULATOR_FILES:
        for node in ast.parse((PACKAGE / name).read_text()).body:  # each class, function, line
            for inner in ast.walk(node):
                names = [getattr(inner, key, None) for key in ("id", "attr", "arg", "module")]
                names += [alias.name for alias in getattr(inner, "names", [])]
                if {"MeshGroup", "mesh", "peers"} & set(names):
                    found.add((name, getattr(node, "name", "<module>"), "mesh"))
                modules = [name.split(".")[-1] for name in names if isinstance(name, str)]
                if isinstance(inner, ast.Import | ast.ImportFrom) and "parallel" in modules:
                    found.add((name, getattr(node, "name", "<module>"), "import"))
    assert found == {
        ("collectives.py", "CollectiveResolver", "mesh"),
        ("collectives.py", "CollectiveResolver", "import"),
    }


def test_the_accumulator_files_are_listed_in_the_order_they_import_each_other() -> None:
    # docs/vendoring.md lists them so that each imports only files before it (imports for type
    # checking and of an optional file, inside a function or a try, aside).
    page = (PACKAGE.parent / "docs" / "vendoring.md").read_text()
    section = page.split("### The `Accumulator`'s files")[1].split("###")[0]
    listed = re.findall(r"^- `(\w+\.py)`:", section, flags=re.M)
    assert sorted(listed) == sorted(ACCUMULATOR_FILES)
    for position, name in enumerate(listed):
        for node in ast.parse((PACKAGE / name).read_text()).body:  # the module's own level
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                modules = [node.module] if node.module else [a.name for a in node.names]
                for module in modules:
                    assert f"{module}.py" in listed[:position], f"{name} imports {module}"


def test_the_math_file_alone_runs_without_torch(tmp_path: Path) -> None:
    shutil.copy(PACKAGE / "weighting.py", tmp_path / "lw_weighting.py")
    run_isolated(
        tmp_path,
        "sys.modules['torch'] = None\n"
        "import lw_weighting\n"
        "assert lw_weighting.backward_scale(3, 4, 2.0, 'mean') == 1.5\n",
    )


def test_the_listed_files_are_all_the_accumulator_imports() -> None:
    # Every module the Accumulator's files import from the package is in the list.
    imported = set()
    for name in ACCUMULATOR_FILES:
        for line in (PACKAGE / name).read_text().splitlines():
            if line.startswith("from ."):
                module = line.split()[1].lstrip(".").split(".")[0]
                if module:
                    imported.add(f"{module}.py")
                else:  # "from . import weighting"
                    imported.update(f"{m.strip()}.py" for m in line.split("import")[1].split(","))
    assert imported <= set(ACCUMULATOR_FILES), imported - set(ACCUMULATOR_FILES)
    # The optional modules are imported where a copy may lack them, never at the top level.
    for name in ACCUMULATOR_FILES:
        text = (PACKAGE / name).read_text()
        assert "\nfrom .parallel import" not in text, name
        assert "\nfrom . import compiled" not in text, name
    # And the page lists exactly these files for the Accumulator.
    page = (PACKAGE.parent / "docs" / "vendoring.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| the `Accumulator`"))
    assert sorted(re.findall(r"`(\w+\.py)`", row)) == sorted(ACCUMULATOR_FILES)
    # And its example copies exactly them.
    listed = re.findall(r"^FILES \+?= \[(.*)\]", page, flags=re.M)
    copied = [name.strip(" '\"") + ".py" for names in listed for name in names.split(",")]
    assert sorted(copied) == sorted(ACCUMULATOR_FILES)
    # And its __init__.py exports what lossweight's own does from those files.
    exported = {
        n for line in re.findall(r"from \.\w+ import ([\w, ]+)\\n", page) for n in line.split(", ")
    }
    own = ast.parse((PACKAGE / "__init__.py").read_text()).body
    kept = {
        alias.name
        for node in own
        if isinstance(node, ast.ImportFrom) and f"{node.module}.py" in ACCUMULATOR_FILES
        for alias in node.names
    }
    assert exported == kept
