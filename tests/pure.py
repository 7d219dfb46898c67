"""Loads lossweight's pure modules as a package of their own, without the package's
``__init__`` (which imports torch): what a property test of the rules, or a vendorer of the
math, runs."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lossweight"
PURE = ("weighting", "errors", "terms", "machine")


def load_pure(name: str = "lw_pure") -> dict[str, types.ModuleType]:
    """The pure modules, loaded from their files as the package ``name``."""
    package = types.ModuleType(name)
    package.__path__ = [str(PACKAGE)]
    sys.modules[name] = package
    modules = {}
    for module in PURE:
        spec = importlib.util.spec_from_file_location(f"{name}.{module}", PACKAGE / f"{module}.py")
        assert spec is not None and spec.loader is not None
        modules[module] = importlib.util.module_from_spec(spec)
        sys.modules[f"{name}.{module}"] = modules[module]
        spec.loader.exec_module(modules[module])
    return modules
