"""The command line: its options, the check that the ``demo`` extra is installed, the output."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path

from . import __doc__ as summary
from .plot import plot
from .report import print_table, train_with_progress


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lossweight.demo``: train, print the table, write the plot."""
    parser = argparse.ArgumentParser(
        prog="python -m lossweight.demo", description=summary.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("lossweight-demo.png"),
        help="where to write the plot (default ./lossweight-demo.png)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: train at least 1 step")
    # Checked before any training, which takes a while, rather than failing at the end.
    missing = [name for name in _needed(plotting=not args.no_plot) if not _installed(name)]
    if missing:
        parser.exit(
            2,
            f"the demo needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: "
            'pip install "lossweight[demo]"'
            + ("" if "rich" in missing else ", or run it with --no-plot")
            + "\n",
        )

    from rich.console import Console

    console = Console()
    runs = train_with_progress(console, args.steps, args.seed)
    print_table(console, runs, args.steps)
    if not args.no_plot:
        plot(runs, args.output)
        console.print(f"Plot written to {args.output.resolve()}")


def _needed(plotting: bool) -> list[str]:
    return ["rich", "matplotlib"] if plotting else ["rich"]


def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
