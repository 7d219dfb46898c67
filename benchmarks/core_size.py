"""The size of the core a user copies (vendors) to get the ``Accumulator``, against its budgets.

docs/vendoring.md asks a user to copy ``ACCUMULATOR_FILES`` into their own package; what they
take on is what this measures, so that the docs can quote the figures and a test can hold them:

    .venv/bin/python -m benchmarks.core_size              # the figures beside their budgets
    .venv/bin/python -m benchmarks.core_size --verbose    # and where they come from
    .venv/bin/python -m benchmarks.core_size --json core_size.json   # and save them

The figures, over those files:

- total lines: physical lines, docstrings, comments and blank lines included (what is read);
- torch-free lines: the lines of the files that import nothing torch-related, directly or
  through the package modules they import, so they can be read, tested and reused without
  torch (found from the source with :mod:`ast`, nothing is imported);
- the longest class and the longest function or method, from ``def``/``class`` to its last
  line (decorators excluded): the largest unit a reader has to hold at once;
- the module boundary crossings of one optimizer step of 2 microbatches, in each mode: the
  calls from one module of the package into another, traced with :func:`sys.setprofile`. Each
  is an interface a reader follows from file to file; calls from or into torch or the caller's
  code are not counted.

The script exits 1 when a figure is over its budget, naming it.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
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
    "steps.py",
    "result.py",
    "accumulator.py",
)

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
    "total_lines": Budget("total lines", 1300),
    "torch_free_lines": Budget("torch-free lines", 350, at_most=False),
    "longest_class": Budget("longest class", 250),
    "longest_function": Budget("longest function", 40),
    "crossings_count_first": Budget("crossings, count first", 20),
    "crossings_scale_after": Budget("crossings, scale after", 20),
}


@dataclass(frozen=True)
class Span:
    """A class or function: ``file:qualified.name`` and its lines."""

    where: str
    lines: int


@dataclass(frozen=True)
class CoreSize:
    """The figures of the vendored core (the module docstring says what each one means)."""

    total_lines: int
    torch_free_lines: int
    lines_per_file: dict[str, int]
    torch_free_files: tuple[str, ...]
    longest_class: Span
    longest_function: Span
    crossings: dict[str, int]
    """Per mode, the package-to-package calls between different modules in one step."""
    calls: dict[str, dict[str, int]]
    """Per mode, ``"caller -> callee.function"``: how many times, the crossings in detail."""
    generated_calls: dict[str, dict[str, int]]
    """Per mode, calls between modules into code that has no file of the package (a
    dataclass's generated ``__init__``, say): crossings for a reader, but not counted."""

    def values(self) -> dict[str, int]:
        """The figures that have a budget, by the keys of ``BUDGETS``."""
        return {
            "total_lines": self.total_lines,
            "torch_free_lines": self.torch_free_lines,
            "longest_class": self.longest_class.lines,
            "longest_function": self.longest_function.lines,
            **{f"crossings_{mode.replace(' ', '_')}": self.crossings[mode] for mode in MODES},
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


def _run_step(acc: lossweight.Accumulator, parameter: torch.Tensor, mode: Mode) -> None:
    """One optimizer step of ``len(COUNTS)`` microbatches, ``loss = parameter * count``."""
    if mode == "count first":
        acc.begin(num_tokens=list(COUNTS))
        for count in COUNTS:
            torch.autograd.backward(acc.scale_loss(parameter * count))
    else:
        acc.begin(parameters=[parameter])
        for count in COUNTS:
            torch.autograd.backward(acc.scale_loss(parameter * count, num_tokens=count))
    acc.end()


def trace_step(mode: Mode, package: Path) -> tuple[Counter[str], Counter[str]]:
    """The calls between modules of ``package`` in one step of ``mode``, after a warm-up step:
    ``"caller -> callee.function"`` with their counts, for calls into a file of the package,
    and apart those into code generated for one of its modules (file ``<string>``)."""
    root = str(package.resolve())
    names: dict[str, str | None] = {}

    def module_of(filename: str) -> str | None:
        """``integrations.hf`` for ``<package>/integrations/hf.py``; None outside it."""
        if filename not in names:
            real = os.path.realpath(filename)
            inside = real.startswith(root + os.sep) and real.endswith(".py")
            relative = real[len(root) + 1 : -len(".py")] if inside else None
            names[filename] = relative.replace(os.sep, ".") if relative is not None else None
        return names[filename]

    prefix = f"{lossweight.__name__}."

    def generated_module(frame: FrameType) -> str | None:
        """The package module of code without a file (``exec``'d in its namespace)."""
        name = frame.f_globals.get("__name__")
        if not isinstance(name, str) or not name.startswith(prefix):
            return None
        return name[len(prefix) :] if not os.path.isfile(frame.f_code.co_filename) else None

    calls: Counter[str] = Counter()
    generated: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or frame.f_back is None:
            return
        caller = module_of(frame.f_back.f_code.co_filename)
        if caller is None:
            return
        code = frame.f_code
        function = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+
        callee = module_of(code.co_filename)
        if callee is not None and callee != caller:
            calls[f"{caller} -> {callee}.{function}"] += 1
        elif callee is None and (made := generated_module(frame)) not in (None, caller):
            generated[f"{caller} -> {made}.{function}"] += 1

    parameter = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = lossweight.Accumulator(loss_reduction="sum")
    _run_step(acc, parameter, mode)  # warm-up: caches, lazy imports
    parameter.grad = None
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        _run_step(acc, parameter, mode)
    finally:
        sys.setprofile(previous)
    # The step's gradient is that of sum(loss) / sum(COUNTS): 1 per unit of count.
    if parameter.grad is None or not math.isclose(parameter.grad.item(), 1.0):
        raise RuntimeError(f"the traced {mode} step gave the gradient {parameter.grad}, not 1")
    return calls, generated


def measure() -> CoreSize:
    """The figures of the vendored core, from the ``lossweight`` that is imported."""
    package = package_dir()
    files = core_files(package)
    lines = {path.name: physical_lines(path) for path in files}
    free = torch_free(files, package)
    free_files = tuple(path.name for path in files if free[path.resolve()])
    longest_class, longest_function = longest(files)
    traced = {mode: trace_step(mode, package) for mode in MODES}
    return CoreSize(
        total_lines=sum(lines.values()),
        torch_free_lines=sum(lines[name] for name in free_files),
        lines_per_file=lines,
        torch_free_files=free_files,
        longest_class=longest_class,
        longest_function=longest_function,
        crossings={mode: sum(calls.values()) for mode, (calls, _) in traced.items()},
        calls={mode: dict(calls.most_common()) for mode, (calls, _) in traced.items()},
        generated_calls={mode: dict(made.most_common()) for mode, (_, made) in traced.items()},
    )


def table(size: CoreSize) -> list[str]:
    """The figures beside their budgets, one line each."""
    where = {
        "longest_class": size.longest_class.where,
        "longest_function": size.longest_function.where,
    }
    lines = [f"{'figure':<24} {'value':>6}  {'budget':<8} {'':<4} where", "-" * 76]
    for key, value in size.values().items():
        budget = BUDGETS[key]
        verdict = "ok" if budget.holds(value) else "OVER"
        lines.append(
            f"{budget.figure:<24} {value:>6}  {budget!s:<8} {verdict:<4} {where.get(key, '')}"
        )
    return lines


def details(size: CoreSize) -> list[str]:
    """Where the figures come from: the files, and each mode's crossings."""
    lines = ["", "files (* torch-free):"]
    for name, count in size.lines_per_file.items():
        mark = "*" if name in size.torch_free_files else " "
        lines.append(f"  {mark} {name:<20} {count:>5}")
    for mode in MODES:
        lines += ["", f"crossings, {mode} ({size.crossings[mode]}):"]
        lines += [f"  {count:>3}  {call}" for call, count in size.calls[mode].items()]
        if size.generated_calls[mode]:
            lines.append("  not counted, into generated code (no file of the package):")
            generated = size.generated_calls[mode].items()
            lines += [f"  {count:>3}  {call}" for call, count in generated]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="also each file and crossing")
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
