"""Tools to test weighting code, one's own training loop included.

- :class:`InProcessGroup`: data-parallel ranks simulated in one process, each with a real
  :class:`lossweight.Collective`, to run a loop's ranks in threads.
- :func:`assert_split_invariant`: runs a training step on its whole batch and on splits of it
  into microbatches and ranks that break naive weighting, and reports any difference in the
  gradient or the logged loss, with its likely cause.
- :func:`count_collectives`: counts the torch.distributed collectives a block issues (DDP's
  and FSDP's included), to assert what a step costs in communication.
- :mod:`lossweight.testing.strategies`: hypothesis strategies (splits, counts, padded labels);
  the only module that imports hypothesis (``pip install "/path/to/lossweight[testing]"``).

This package is not imported by ``import lossweight``.
"""

from ._checker import ContextShard, Split, assert_split_invariant, default_splits
from ._collectives import CollectiveCounts, count_collectives
from ._group import InProcessCollective, InProcessGroup

__all__ = [
    "CollectiveCounts",
    "ContextShard",
    "InProcessCollective",
    "InProcessGroup",
    "Split",
    "assert_split_invariant",
    "count_collectives",
    "default_splits",
]
