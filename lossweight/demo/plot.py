"""The plot: each run's training loss, naive splits on the left, lossweight's on the right."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .data import SPLITS
from .training import METHODS, Run


def plot(runs: Sequence[Run], path: Path) -> None:
    """Write the loss curves of ``runs`` to ``path``, a PNG.

    matplotlib is imported here, not with the module, so that the demo loads without its
    ``demo`` extra and can say what is missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = dict(zip(SPLITS, ("black", "tab:blue", "tab:orange", "tab:green"), strict=True))
    # Curves that coincide (lossweight's) stay visible: each split has its own dash pattern
    # and marker, drawn with a thinner line than the one below it.
    styles = dict(zip(SPLITS, ("-", "--", "-.", ":"), strict=True))
    markers = dict(zip(SPLITS, ("o", "s", "^", "x"), strict=True))
    for axis, method in zip(axes, METHODS, strict=True):
        for order, run in enumerate(r for r in runs if r.method == method):
            axis.plot(
                run.losses,
                color=colors[run.split],
                linestyle=styles[run.split],
                marker=markers[run.split],
                markevery=max(1, len(run.losses) // 8) + order,
                linewidth=2.4 - 0.5 * order,
                label=run.split,
                alpha=0.9,
            )
        title = "loss / accumulation_steps" if method == "naive" else "lossweight (tokens)"
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("token-mean training loss")
    axes[1].legend(title="ranks x microbatches")
    figure.suptitle("Same batches, different splits: naive weighting fans out, lossweight does not")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
