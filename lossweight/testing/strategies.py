"""Hypothesis strategies for testing weighting code: splits, counts, padded labels.

This is the one module of lossweight that imports hypothesis (``pip install
"lossweight[testing]"``). Each strategy draws the cases that break naive weighting often:
empty microbatches, ranks with no microbatch, counts of 0, rows that are all padding.
"""

from __future__ import annotations

import itertools
from typing import Literal

import torch
from hypothesis import strategies as st

SplitRanks = list[list[list[int]]]


@st.composite
def splits(
    draw: st.DrawFn,
    num_items: int,
    *,
    max_ranks: int = 4,
    max_microbatches: int = 4,
    shuffle: bool = True,
) -> SplitRanks:
    """A split of the items ``0 .. num_items - 1`` into ranks of microbatches.

    ``result[r][i]`` lists the items of microbatch ``i`` of rank ``r``: every item appears
    exactly once. There are 1 to ``max_ranks`` ranks, each with 0 to ``max_microbatches``
    microbatches (rank 0 has at least one, so that the items have somewhere to go), and
    microbatches may be empty. The items are cut into consecutive runs, in a drawn order
    unless ``shuffle=False``.
    """
    world_size = draw(st.integers(1, max_ranks))
    per_rank = [draw(st.integers(0, max_microbatches)) for _ in range(world_size)]
    per_rank[0] = max(per_rank[0], 1)
    slots = sum(per_rank)
    items = list(range(num_items))
    if shuffle:
        items = draw(st.permutations(items))
    cuts = sorted(draw(st.lists(st.integers(0, num_items), min_size=slots - 1, max_size=slots - 1)))
    bounds = [0, *cuts, num_items]
    microbatches = [items[start:stop] for start, stop in itertools.pairwise(bounds)]
    ranks, first = [], 0
    for count in per_rank:
        ranks.append(microbatches[first : first + count])
        first += count
    return ranks


def counts(*, max_size: int = 10, max_count: int = 10**6) -> st.SearchStrategy[list[int]]:
    """Lists of counts, 0 or more each, with zeros and ones more often than chance gives."""
    count = st.one_of(st.just(0), st.just(1), st.integers(0, max_count))
    return st.lists(count, max_size=max_size)


@st.composite
def padded_labels(
    draw: st.DrawFn,
    *,
    rows: int | None = None,
    length: int | None = None,
    vocabulary: int = 16,
    ignore_index: int = -100,
    padding: Literal["right", "left", "either"] = "either",
) -> torch.Tensor:
    """An int64 label tensor of shape ``(rows, length)`` whose rows hold 0 to ``length`` real
    tokens, padded with ``ignore_index`` on the right, on the left, or either way per tensor.
    Rows that are all padding, and full rows, come up often."""
    rows = draw(st.integers(1, 6)) if rows is None else rows
    length = draw(st.integers(1, 12)) if length is None else length
    side = draw(st.sampled_from(["right", "left"])) if padding == "either" else padding
    lengths = draw(
        st.lists(
            st.one_of(st.just(0), st.just(length), st.integers(0, length)),
            min_size=rows,
            max_size=rows,
        )
    )
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocabulary, (rows, length), generator=generator)
    positions = torch.arange(length).expand(rows, length)
    real = torch.tensor(lengths, dtype=torch.int64).unsqueeze(1)
    padded = positions >= real if side == "right" else positions < length - real
    return labels.masked_fill(padded, ignore_index)
