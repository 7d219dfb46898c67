"""A step with several loss terms, each with its own normaliser, and its full-batch fp64 truth.

Each example is a sequence of 0 or more tokens, each token with features and a float weight
(0 or more), and the sequence with features of its own. A token-local model (no mixing across
tokens or sequences) gives each token an output ``o`` and each sequence an output ``q``. The
terms, as an RL or MoE step holds them:

- ``lm``: ``softplus(o)`` summed over tokens, over the step's token count (``"sum"``, tokens);
- ``mtp``: each microbatch's mean of ``o**2 / 2`` over its tokens (``"mean"``, tokens), NaN for a
  microbatch without tokens (0/0);
- ``aux``: each microbatch's mean of ``sigmoid(q)`` over its sequences (``"mean"``, samples);
- ``kl``: ``w * o**2 / 2`` summed over tokens, over the step's sum of weights (``"sum"``,
  ``weight_sum``);
- ``dr``: ``softplus(o)`` summed, over a constant (``"sum"``, ``CONSTANT``), as Dr. GRPO.

Over the whole step each term is its sum over every token (or sequence) divided by its
normaliser (0 where that is 0); the step's loss is their sum. The tests split the sequences
into ranks and microbatches and compare lossweight's gradient and logged losses with these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lossweight import Term

FEATURES = 3
CONSTANT = 16.0
TERMS = {
    "lm": Term("lm", "sum", "tokens"),
    "mtp": Term("mtp", "mean", "tokens"),
    "aux": Term("aux", "mean", "samples"),
    "kl": Term("kl", "sum", "weight_sum"),
    "dr": Term("dr", "sum", CONSTANT),
}
# The sets of terms a scale-after step can make exact: one count normalises them all.
RESCALABLE = (("lm", "mtp"), ("lm",), ("aux",), ("kl",), ("mtp",))


@dataclass
class Sequences:
    tokens: list[torch.Tensor]  # per sequence, (length, FEATURES)
    weights: list[torch.Tensor]  # per sequence, (length,), each 0 or more
    features: torch.Tensor  # (sequences, FEATURES)


def make_sequences(lengths: list[int], seed: int) -> Sequences:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    weights = []
    for length in lengths:
        drawn = torch.rand(length, generator=generator, dtype=torch.float64) * 2
        weights.append(torch.where(drawn < 0.3, 0.0, drawn))  # some weights exactly 0
    return Sequences(
        [normal(n, FEATURES) for n in lengths], weights, normal(len(lengths), FEATURES)
    )


class Model(torch.nn.Module):
    """Token-local: a token's output depends on its own features, a sequence's on its own."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.token = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
        ).double()
        self.sequence = torch.nn.Linear(FEATURES, 1).double()

    def forward(self, tokens: torch.Tensor, sequences: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.token(tokens).squeeze(-1), self.sequence(sequences).squeeze(-1)


def _pieces(model: torch.nn.Module, data: Sequences, rows: list[int]) -> dict[str, torch.Tensor]:
    tokens = torch.cat([data.tokens[i] for i in rows] or [torch.zeros(0, FEATURES).double()])
    weights = torch.cat([data.weights[i] for i in rows] or [torch.zeros(0).double()])
    index = torch.tensor(rows, dtype=torch.int64)
    out, sequence_out = model(tokens, data.features[index])
    return {
        "softplus": F.softplus(out),
        "square": out**2 / 2,
        "gate": torch.sigmoid(sequence_out),
        "weights": weights,
    }


def microbatch(
    model: torch.nn.Module, data: Sequences, rows: list[int], names: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The losses of the named terms for the sequences ``rows``, and their counts (the weight
    sum as a tensor, as a loop computes it from its batch)."""
    p = _pieces(model, data, rows)
    losses = {
        "lm": p["softplus"].sum(),
        "mtp": p["square"].mean(),  # NaN without tokens
        "aux": p["gate"].mean(),  # NaN without sequences
        "kl": (p["weights"] * p["square"]).sum(),
        "dr": p["softplus"].sum(),
    }
    counts = {
        "num_tokens": len(p["weights"]),
        "num_samples": len(rows),
        "weight_sum": p["weights"].sum(),
    }
    return {name: losses[name] for name in names}, counts


def reference(
    model: torch.nn.Module, data: Sequences, names: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Each named term's loss over the whole step (0 where its normaliser is 0), and the
    step's counts."""
    p = _pieces(model, data, list(range(len(data.tokens))))
    tokens, sequences, weight = len(p["weights"]), len(data.tokens), p["weights"].sum()

    def over(total: torch.Tensor, normaliser: float | torch.Tensor) -> torch.Tensor:
        return total / normaliser if normaliser > 0 else total * 0

    losses = {
        "lm": over(p["softplus"].sum(), tokens),
        "mtp": over(p["square"].sum(), tokens),
        "aux": over(p["gate"].sum(), sequences),
        "kl": over((p["weights"] * p["square"]).sum(), weight),
        "dr": p["softplus"].sum() / CONSTANT,
    }
    counts = {"num_tokens": tokens, "num_samples": sequences, "weight_sum": float(weight)}
    return {name: losses[name] for name in names}, counts
