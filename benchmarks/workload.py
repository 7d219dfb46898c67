"""What every variant trains on: a small GPT-style model and padded microbatches."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


class GPT(nn.Module):
    """A small GPT-style decoder: token and position embeddings, causal pre-norm blocks."""

    def __init__(self, vocabulary: int, context: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width,
            nhead=4,
            dim_feedforward=4 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def token_mean_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE
    )


def make_microbatches(
    args: argparse.Namespace, rank: int, step: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's microbatches for one step: right-padded rows of random lengths."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step * 101 + rank)
    microbatches = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocabulary, (args.rows, args.context), generator=generator)
        lengths = torch.randint(2, args.context + 1, (args.rows, 1), generator=generator)
        labels = tokens.masked_fill(torch.arange(args.context) >= lengths, IGNORE)
        microbatches.append((tokens.to(device), labels.to(device)))
    return microbatches
