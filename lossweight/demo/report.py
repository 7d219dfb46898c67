"""The console report: a progress bar per run while they train, then the table of results.

rich is imported in the functions, not with the module, so that the demo loads without its
``demo`` extra and can say what is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .data import BATCH, SPLITS
from .training import METHODS, Run, run_demo

if TYPE_CHECKING:
    from rich.console import Console


def train_with_progress(console: Console, steps: int, seed: int) -> list[Run]:
    """Say what the runs compare, then train them, each behind its own progress bar."""
    from rich.progress import Progress

    console.print(
        "Each split trains twice on the same batches of sequences of very different lengths: "
        "naive = loss / accumulation_steps (every microbatch's mean weighs the same, and the "
        "ranks are averaged), lossweight = each microbatch weighted by its target tokens."
    )
    with Progress(console=console, transient=True) as bar:
        tasks = {
            (split, method): bar.add_task(f"{split:>13}  {method}", total=steps)
            for split in SPLITS
            for method in METHODS
        }
        return run_demo(steps, seed, lambda split, method: bar.advance(tasks[(split, method)]))


def print_table(console: Console, runs: list[Run], steps: int) -> None:
    """Print each run's first-step gradient error and held-out loss, naive runs first."""
    from rich.table import Table

    table = Table(title=f"{steps} steps of a tiny causal LM, {BATCH} sequences a step")
    table.add_column("ranks x microbatches")
    table.add_column("weighting")
    table.add_column("gradient vs 1 x 1, step 1", justify="right")
    table.add_column(f"held-out loss after {steps} steps", justify="right")
    for run in sorted(runs, key=lambda r: (METHODS.index(r.method), list(SPLITS).index(r.split))):
        table.add_row(
            run.split, run.method, f"{run.gradient_difference:.1e}", f"{run.eval_loss:.4f}"
        )
    console.print(table)
    console.print(
        "The gradient column is the largest difference to the 1 x 1 gradient, relative to its "
        "largest entry. lossweight's splits agree to float round-off; the naive ones do not."
    )
