"""The size of the core a user copies (vendors) to get the ``Accumulator``, against its budgets.

docs/vendoring.md asks a user to copy ``ACCUMULATOR_FILES`` into their own package (and
``PARALLEL_FILES`` for meshes and pipelines); what they take on is what this measures, so that
the docs can quote the figures and a test can hold them:

    .venv/bin/python -m benchmarks.core_size              # the figures beside their budgets
    .venv/bin/python -m benchmarks.core_size --verbose    # and where they come from
    .venv/bin/python -m benchmarks.core_size --json core_size.json   # and save them

The figures, over those files:

- code lines (the vendor cost): the lines of code, without docstrings, comments or blank
  lines, which generate the API reference or explain, and which a vendorer may cut;
- parallel code lines: the code lines of ``PARALLEL_FILES``, the optional module of the
  parallel layouts beyond plain data parallelism (meshes, tensor-parallel checks, pipelines),
  which a vendorer of plain data parallelism does not copy;
- compiled code lines, for information: those of ``COMPILED_FILES``, the optional module of
  torch.compile support, which a vendorer who never compiles ``scale_loss()`` does not copy;
- one sitting, per mode: the distinct lines of the core that one realistic step runs (2
  microbatches of mean losses, ``loss_logging="end"``, the step's loss read), traced with
  :func:`sys.settrace`: what a reader follows to understand one step;
- total lines, for information: physical lines, docstrings, comments and blank lines
  included (what is read);
- torch-free lines: the lines of the files that import nothing torch-related, directly or
  through the package modules they import, so they can be read, tested and reused without
  torch (found from the source with :mod:`ast`, nothing is imported);
- the longest class and the longest function or method, from ``def``/``class`` to its last
  line (decorators excluded): the largest unit a reader has to hold at once.

The script exits 1 when a figure is over its budget, naming it.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import math
import os
import sys
import tokenize
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Literal

import torch

import lossweight

ACCUMULATOR_FILES = (
    "weighting.py",
    "terms.py",
    "machine.py",
    "errors.py",
    "_torch.py",
    "payload.py",
    "collectives.py",
    "ledger.py",
    "steps.py",
    "result.py",
    "accumulator.py",
)

PARALLEL_FILES = ("parallel.py",)
"""What a vendorer adds for DeviceMesh groups, tensor-parallel checks and pipeline stages."""

COMPILED_FILES = ("compiled.py",)
"""What a vendorer adds to call a count-first ``scale_loss()`` inside torch.compile."""

Mode = Literal["count first", "scale after"]
MODES: tuple[Mode, ...] = ("count first", "scale after")
COUNTS = (3, 1)  # the tokens of the traced step's 2 microbatches


@dataclass(frozen=True)
class Budget:
    """A bound on one figure: ``value <= limit`` (``at_most``) or ``value >= limit``."""

    figure: str
    limit: int
    at_most: bool = True

    def holds(self, value: int) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit

    def __str__(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.limit}"


BUDGETS = {
    "code_lines": Budget("code lines", 1400),
    "parallel_code_lines": Budget("parallel code lines", 250),
    "sitting_count_first": Budget("one sitting, count first", 250),
    "sitting_scale_after": Budget("one sitting, scale after", 250),
    "torch_free_lines": Budget("torch-free lines", 350, at_most=False),
    "longest_class": Budget("longest class", 250),
    "longest_function": Budget("longest function", 40),
}


@dataclass(frozen=True)
class Span:
    """A class or function: ``file:qualified.name`` and its lines."""

    where: str
    lines: int


@dataclass(frozen=True)
class CoreSize:
    """The figures of the vendored core (the module docstring says what each one means)."""

    code_lines: int
    parallel_code_lines: int
    compiled_code_lines: int
    """The code lines of ``COMPILED_FILES``, for information."""
    sitting: dict[str, int]
    """Per mode, the distinct core lines one realistic step runs."""
    sitting_per_file: dict[str, dict[str, int]]
    """Per mode, those lines by file."""
    total_lines: int
    torch_free_lines: int
    lines_per_file: dict[str, int]
    """Each file's physical lines."""
    code_lines_per_file: dict[str, int]
    torch_free_files: tuple[str, ...]
    longest_class: Span
    longest_function: Span

    def values(self) -> dict[str, int]:
        """The figures that have a budget, by the keys of ``BUDGETS``."""
        return {
            "code_lines": self.code_lines,
            "parallel_code_lines": self.parallel_code_lines,
            **{f"sitting_{mode.replace(' ', '_')}": self.sitting[mode] for mode in MODES},
            "torch_free_lines": self.torch_free_lines,
            "longest_class": self.longest_class.lines,
            "longest_function": self.longest_function.lines,
        }

    def over_budget(self) -> list[str]:
        """A line for each figure over its budget; empty when all hold."""
        return [
            f"{BUDGETS[key].figure} is {value}, over its budget ({BUDGETS[key]})"
            for key, value in self.values().items()
            if not BUDGETS[key].holds(value)
        ]


def package_dir() -> Path:
    """The directory of the imported ``lossweight``, the one whose files are measured."""
    return Path(lossweight.__file__).resolve().parent


def core_files(package: Path, names: Sequence[str] = ACCUMULATOR_FILES) -> list[Path]:
    """The listed files of ``package``; a clear error if one is missing (renamed or deleted)."""
    missing = [name for name in names if not (package / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"ACCUMULATOR_FILES lists {', '.join(missing)}, not found in {package}; "
            "update benchmarks/core_size.py (and docs/vendoring.md) if the core was reorganised"
        )
    return [package / name for name in names]


def physical_lines(path: Path) -> int:
    """Lines as an editor numbers them (a last line without a newline counts)."""
    return len(path.read_bytes().splitlines())


def code_lines(path: Path) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring (the first
    string statement of the module, a class or a function)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                skipped.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    code = {
        line
        for token in tokens
        if token.type not in _NOT_CODE
        for line in range(token.start[0], token.end[0] + 1)
    }
    return len(code - skipped)


_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def _is_torch(module: str) -> bool:
    """Whether a top-level import name is torch or a package built on it."""
    root = module.split(".")[0]
    return root.startswith("torch") or root == "functorch"


def _module_file(directory: Path, dotted: str) -> Path | None:
    """The file of module ``dotted`` under ``directory``, or None if there is none."""
    target = directory.joinpath(*dotted.split("."))
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _subpackage_inits(directory: Path, dotted: str) -> list[Path]:
    """The ``__init__.py`` files an import of ``dotted`` from ``directory`` runs on the way
    (``a/__init__.py`` for ``a.b``); not ``directory``'s own, which a vendorer writes."""
    parts = dotted.split(".")[:-1]
    inits = [directory.joinpath(*parts[: i + 1], "__init__.py") for i in range(len(parts))]
    return [init for init in inits if init.is_file()]


def _resolve(importer: Path, directory: Path, dotted: str, names: Sequence[str]) -> list[Path]:
    """The package files that ``from <directory>.<dotted> import names`` runs (``dotted`` empty
    for ``from . import names``): the module, or for each name the submodule of that name or,
    when there is none, the package's ``__init__.py`` that defines it."""
    found: list[Path] = []
    if dotted:
        module = _module_file(directory, dotted)
        if module is None:
            raise FileNotFoundError(f"{importer} imports {dotted!r}, not found in {directory}")
        found += [*_subpackage_inits(directory, dotted), module]
        if module.name != "__init__.py":
            return found
        directory = module.parent
    for name in names:
        submodule = _module_file(directory, name) if name != "*" else None
        found.append(submodule if submodule is not None else directory / "__init__.py")
    return [path for path in found if path.is_file()]


def imports_of(path: Path, package: Path) -> tuple[bool, set[Path]]:
    """Whether ``path`` imports torch itself (anywhere in it, under ``TYPE_CHECKING`` or in a
    function too), and the files of ``package`` that its imports run.

    A relative import is resolved in the file's own directory, as it would be in a vendored
    copy: the package's ``__init__.py`` is then the vendorer's own, not counted unless a name
    is imported from it. An absolute import of the package (``lossweight.x``) runs the
    installed package's ``__init__.py`` as well, so that is counted too.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    imports_torch = False
    modules: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports_torch |= _is_torch(alias.name)
                if alias.name.split(".")[0] == package.name:
                    inner = alias.name.partition(".")[2]
                    modules |= {package / "__init__.py"}
                    modules |= set(_resolve(path, package, inner, [])) if inner else set()
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level == 0:
                module = node.module or ""
                imports_torch |= _is_torch(module)
                if module.split(".")[0] == package.name:
                    inner = module.partition(".")[2]
                    modules |= {package / "__init__.py"}
                    modules |= set(_resolve(path, package, inner, names))
                continue
            directory = path.parent
            for _ in range(node.level - 1):
                directory = directory.parent
            if not directory.is_relative_to(package):
                raise ValueError(
                    f"{path} imports {'.' * node.level}{node.module or ''} "
                    f"from above the package {package}"
                )
            modules |= set(_resolve(path, directory, node.module or "", names))
    return imports_torch, modules


def torch_free(files: Iterable[Path], package: Path) -> dict[Path, bool]:
    """Whether each file, and each package file it reaches through its imports, is torch-free:
    it imports no torch, and every package module it imports is torch-free. Import cycles are
    fine: a file is torch-related exactly when one reaches a file that imports torch."""
    direct: dict[Path, bool] = {}
    edges: dict[Path, set[Path]] = {}
    pending = [path.resolve() for path in files]
    while pending:
        path = pending.pop()
        if path in direct:
            continue
        direct[path], edges[path] = imports_of(path, package.resolve())
        pending += [module for module in edges[path] if module not in direct]
    tainted = {path for path, imports_torch in direct.items() if imports_torch}
    changed = True
    while changed:
        grown = {path for path, modules in edges.items() if modules & tainted} - tainted
        tainted |= grown
        changed = bool(grown)
    return {path: path not in tainted for path in direct}


def longest(files: Sequence[Path]) -> tuple[Span, Span]:
    """The longest class and the longest function or method (nested ones too) of ``files``,
    from their ``class``/``def`` line to their last line."""
    spans: dict[bool, list[Span]] = {True: [], False: []}  # is a class

    def visit(node: ast.AST, path: Path, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{scope}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                spans[isinstance(child, ast.ClassDef)].append(Span(f"{path.name}:{name}", lines))
                visit(child, path, f"{name}.")
            else:
                visit(child, path, scope)

    for path in files:
        visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), path, "")
    if not spans[True] or not spans[False]:
        raise ValueError("the listed files define no class or no function")
    return (
        max(spans[True], key=lambda span: span.lines),
        max(spans[False], key=lambda span: span.lines),
    )


def _realistic_step(mode: Mode) -> Callable[[], None]:
    """One step as a user's loop runs it: mean losses of ``COUNTS`` tokens each, the default
    ``loss_logging="end"``, and the step's loss read. A warm-up step runs first."""
    parameter = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = lossweight.Accumulator(loss_reduction="mean")

    def step() -> None:
        parameter.grad = None
        if mode == "count first":
            acc.begin(num_tokens=list(COUNTS))
        else:
            acc.begin(parameters=[parameter])
        for count in COUNTS:
            counts = {} if mode == "count first" else {"num_tokens": count}
            torch.autograd.backward(acc.scale_loss(parameter * 2.0, **counts))
        if not math.isclose(acc.end().loss.item(), 2.0):
            raise RuntimeError(f"the traced {mode} step did not log the loss 2")

    step()  # warm-up: caches, lazy imports
    return step


def sitting(mode: Mode, files: Sequence[Path]) -> set[tuple[str, int]]:
    """The distinct lines of ``files`` that one realistic step of ``mode`` runs."""
    wanted = {os.path.realpath(path): path.name for path in files}
    seen: set[tuple[str, int]] = set()

    def local(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if event == "line":
            seen.add((wanted[os.path.realpath(frame.f_code.co_filename)], frame.f_lineno))
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        inside = os.path.realpath(frame.f_code.co_filename) in wanted
        return local if event == "call" and inside else None

    step = _realistic_step(mode)
    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        step()
    finally:
        sys.settrace(previous)
    return seen


def measure() -> CoreSize:
    """The figures of the vendored core, from the ``lossweight`` that is imported."""
    package = package_dir()
    files = core_files(package)
    lines = {path.name: physical_lines(path) for path in files}
    code = {path.name: code_lines(path) for path in files}
    free = torch_free(files, package)
    free_files = tuple(path.name for path in files if free[path.resolve()])
    longest_class, longest_function = longest(files)
    traced = {mode: Counter(name for name, _ in sitting(mode, files)) for mode in MODES}
    return CoreSize(
        code_lines=sum(code.values()),
        parallel_code_lines=sum(map(code_lines, core_files(package, PARALLEL_FILES))),
        compiled_code_lines=sum(map(code_lines, core_files(package, COMPILED_FILES))),
        sitting={mode: sum(per_file.values()) for mode, per_file in traced.items()},
        sitting_per_file={mode: dict(per_file.most_common()) for mode, per_file in traced.items()},
        total_lines=sum(lines.values()),
        torch_free_lines=sum(lines[name] for name in free_files),
        lines_per_file=lines,
        code_lines_per_file=code,
        torch_free_files=free_files,
        longest_class=longest_class,
        longest_function=longest_function,
    )


def table(size: CoreSize) -> list[str]:
    """The figures beside their budgets, one line each, then the total for information."""
    where = {
        "longest_class": size.longest_class.where,
        "longest_function": size.longest_function.where,
    }
    lines = [f"{'figure':<26} {'value':>6}  {'budget':<8} {'':<4} where", "-" * 78]
    for key, value in size.values().items():
        budget = BUDGETS[key]
        verdict = "ok" if budget.holds(value) else "OVER"
        lines.append(
            f"{budget.figure:<26} {value:>6}  {budget!s:<8} {verdict:<4} {where.get(key, '')}"
        )
    lines.append(f"{'total lines':<26} {size.total_lines:>6}  (docstrings included)")
    lines.append(f"{'compiled code lines':<26} {size.compiled_code_lines:>6}  (torch.compile)")
    return lines


def details(size: CoreSize) -> list[str]:
    """Where the figures come from: each file's lines, and each mode's sitting by file."""
    lines = ["", "files (* torch-free): code lines, physical lines"]
    for name, count in size.lines_per_file.items():
        mark = "*" if name in size.torch_free_files else " "
        lines.append(f"  {mark} {name:<20} {size.code_lines_per_file[name]:>5} {count:>6}")
    for mode in MODES:
        lines += ["", f"one sitting, {mode} ({size.sitting[mode]}):"]
        lines += [f"  {name:<22} {count:>5}" for name, count in size.sitting_per_file[mode].items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="also each file and mode")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    size = measure()
    print(f"lossweight {lossweight.__version__}, {len(ACCUMULATOR_FILES)} files\n")
    print("\n".join(table(size)))
    if args.verbose:
        print("\n".join(details(size)))
    if args.json is not None:
        record = {**asdict(size), "budgets": {key: str(b) for key, b in BUDGETS.items()}}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    over = size.over_budget()
    for line in over:
        print(f"over budget: {line}", file=sys.stderr)
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
