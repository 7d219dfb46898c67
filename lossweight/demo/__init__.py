"""Watch the gradient-accumulation bug happen, and lossweight fix it: ``python -m lossweight.demo``.

A tiny causal language model, built here with no download, trains on synthetic sequences of
very different lengths (most are short, a few fill the context; the rest is padding). The same
global batches are split four ways: one microbatch (the reference), 8 microbatches on one rank,
8 ranks of one microbatch each (simulated in this process, grouped by length so that their
token counts differ a lot), and 2 real gloo processes of 4 microbatches each. Each split trains
twice: with the usual ``loss / accumulation_steps`` (each microbatch's mean loss weighs the
same), and with lossweight's token weighting. The first changes the gradient with the split;
the second gives the reference gradient to float round-off.

Needs the ``demo`` extra (rich for the progress and the table, matplotlib for the plot).

- ``data``: the synthetic batches, and their splits into ranks and microbatches.
- ``model``: the tiny causal language model.
- ``training``: the runs, in this process and on 2 gloo processes.
- ``report``: the progress bars and the table on the console.
- ``plot``: the loss curves.
- ``cli``: the command line, ``main``.
"""

from .cli import main
from .data import SPLITS, make_batches
from .model import TinyLM
from .plot import plot
from .training import METHODS, Run, run_demo

__all__ = ["METHODS", "SPLITS", "Run", "TinyLM", "main", "make_batches", "plot", "run_demo"]
