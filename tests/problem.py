"""A small fp64 problem shared by the tests: padded data, its splits, and the full-batch truth.

Each row of a batch is a sample; its positions are tokens, some of them padding (label
IGNORE). Weighting by tokens, the step's loss is the cross-entropy averaged over every
non-padding token of the global batch; weighting by samples, it is the average over rows of
each row's mean token loss. The tests split a batch into ranks and microbatches and check that
lossweight reproduces these full-batch values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100
FEATURES = 3
CLASSES = 4


@dataclass
class Batch:
    features: torch.Tensor  # (rows, length, FEATURES), float64
    labels: torch.Tensor  # (rows, length), int64, IGNORE where padded

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(self.features[start:stop], self.labels[start:stop])

    def take(self, rows: list[int]) -> Batch:
        index = torch.tensor(rows, dtype=torch.int64)
        return Batch(self.features[index], self.labels[index])

    @property
    def num_samples(self) -> int:
        return self.labels.shape[0]

    @property
    def num_tokens(self) -> torch.Tensor:
        return (self.labels != IGNORE).sum()


def make_batch(lengths: list[int], max_length: int, seed: int, left_padding: bool) -> Batch:
    """Rows with the given numbers of real tokens, padded to ``max_length``."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    features = torch.randn(rows, max_length, FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (rows, max_length), generator=generator)
    positions = torch.arange(max_length).expand(rows, max_length)
    length = torch.tensor(lengths, dtype=torch.int64).unsqueeze(1)
    padded = positions < max_length - length if left_padding else positions >= length
    labels = labels.masked_fill(padded, IGNORE)
    return Batch(features, labels)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    hidden = 5
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, CLASSES)
    ).double()


def microbatch_loss(
    model: torch.nn.Module, batch: Batch, weight_by: str, loss_reduction: str
) -> torch.Tensor:
    """The loss of one microbatch: the mean or the sum of its items' losses."""
    logits = model(batch.features)
    token_losses = F.cross_entropy(
        logits.reshape(-1, CLASSES),
        batch.labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).view(batch.labels.shape)
    if weight_by == "tokens":
        total = token_losses.sum()  # padding positions hold 0
        return total / batch.num_tokens if loss_reduction == "mean" else total
    mask = batch.labels != IGNORE
    row_losses = token_losses.sum(dim=1) / mask.sum(dim=1)
    return row_losses.mean() if loss_reduction == "mean" else row_losses.sum()


def reference(model: torch.nn.Module, batch: Batch, weight_by: str) -> tuple[float, list]:
    """The full-batch loss and gradient, on a copy of the model; zero for an empty batch."""
    model = copy.deepcopy(model)
    weight = batch.num_tokens if weight_by == "tokens" else batch.num_samples
    if int(weight) == 0:
        return 0.0, [torch.zeros_like(p) for p in model.parameters()]
    loss = microbatch_loss(model, batch, weight_by, "mean")
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def split(total: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive (start, stop) row ranges of the given sizes, which must add up to total."""
    assert sum(sizes) == total, (sizes, total)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def max_relative_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest difference over all tensors, relative to the largest expected entry."""
    scale = max(float(e.abs().max()) for e in expected) or 1.0
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected, strict=True)) / scale
