"""The model the demo trains: a tiny causal language model, built here, nothing downloaded."""

from __future__ import annotations

import torch
from torch import nn

from .data import CONTEXT, VOCABULARY


class TinyLM(nn.Module):
    """One pre-norm transformer block with causal attention: small, but a real causal LM."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Embedding(CONTEXT, width)
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, num_heads=2, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length))
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)  # True: may not attend
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        logits: torch.Tensor = self.head(x + self.mlp(self.norm2(x)))
        return logits
