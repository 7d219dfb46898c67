"""The demo's data: padded sequences of very different lengths, and the splits of a batch.

The splits hold the same rows; only how they are cut into ranks and microbatches differs, so
any difference between their gradients comes from the loss weighting alone.
"""

from __future__ import annotations

import math

import torch

VOCABULARY = 32
CONTEXT = 64  # the longest sequence; every row is right-padded to it
BATCH = 16  # sequences per optimizer step
IGNORE = -100

# Sequences per microbatch, per rank. "8 x 1" holds the same rows as the others, sorted by
# length first, so that its ranks hold very different numbers of tokens.
SPLITS: dict[str, list[list[int]]] = {
    "1 x 1": [[16]],
    "1 x 8": [[2] * 8],
    "8 x 1": [[2]] * 8,
    "2 x 4 (gloo)": [[1, 3, 2, 2], [4, 2, 1, 1]],
}
GLOO_SPLIT = "2 x 4 (gloo)"


def make_batches(seed: int, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``steps`` training batches and one held-out batch of right-padded sequences.

    Short and long sequences come from two different Markov chains, so a method that
    overweights the tokens of short sequences learns a different model.
    """
    generator = torch.Generator().manual_seed(seed)
    chains = [
        torch.softmax(4 * torch.randn(VOCABULARY, VOCABULARY, generator=generator), dim=-1)
        for _ in range(2)
    ]

    def batch(rows: int) -> torch.Tensor:
        # Lengths spread over two orders of magnitude: log-uniform between 2 and CONTEXT.
        lengths = torch.exp(torch.rand(rows, generator=generator) * math.log(CONTEXT / 2))
        lengths = (2 * lengths).long().clamp(2, CONTEXT)
        tokens = torch.full((rows, CONTEXT), IGNORE, dtype=torch.int64)
        for row, length in enumerate(lengths.tolist()):
            chain = chains[int(length > 16)]
            token = int(torch.randint(VOCABULARY, (), generator=generator))
            for position in range(length):
                tokens[row, position] = token
                token = int(torch.multinomial(chain[token], 1, generator=generator))
        return tokens

    return [batch(BATCH) for _ in range(steps)], batch(64)


def inputs_and_labels(sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (padding replaced by 0) and labels (-100 on the padding)."""
    return sequences.clamp(min=0), sequences


def microbatches(batch: torch.Tensor, split: str) -> list[list[torch.Tensor]]:
    """The rows of each microbatch of each rank of ``split``."""
    if split == "8 x 1":
        batch = batch[(batch != IGNORE).sum(dim=1).argsort(stable=True)]
    ranks: list[list[torch.Tensor]] = []
    start = 0
    for sizes in SPLITS[split]:
        ranks.append([])
        for size in sizes:
            ranks[-1].append(batch[start : start + size])
            start += size
    return ranks
